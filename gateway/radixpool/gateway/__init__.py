"""The RadixPool gateway: a lean streaming HTTP proxy that routes each request to the worker most
likely to hold its prompt prefix in KV cache, and corrects its beliefs from the workers' reports.

Pure core (no I/O): `config`, `prefix_index`, `policies`, `route_key`, `health`, `discovery`
(EndpointSlice logic), `feedback`. I/O shell: `http_edge` (uvicorn), `upstream`, `proxy`,
`monitor`, `kubernetes_watch`, `server`, `cli`. Nothing here imports torch. (Simulated workers
for tests and benchmarks live outside the product, in `bench/simfleet`.)
"""
