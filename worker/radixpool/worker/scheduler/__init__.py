"""Continuous batching: the waiting queue, admission, decode, retraction."""
