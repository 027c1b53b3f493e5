"""Contracts shared by the worker, the gateway, the dashboards and the docs.

Everything here is torch-free and I/O-free: metric names, the KV block-hash scheme behind the
worker's cache-event stream, and the worker's `/server_info` document. Each is defined once and
imported by both sides, so a name or a hash can never drift between producer and consumer.
"""
