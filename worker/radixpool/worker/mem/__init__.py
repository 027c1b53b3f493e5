"""KV memory: the paged token-slot pool, the request→slot table, and the radix prefix cache."""
