"""Attention backends over the paged KV pool, behind one interface and a registry."""
