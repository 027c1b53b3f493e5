"""The local fleet: workers and a gateway on one machine (`radixpool up`, `radixpool demo`, the
end-to-end tests). Torch-free: it starts the worker as a separate process."""
