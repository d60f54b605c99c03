"""One model on one device: the runner, attention backends and CPU kernels, KV caches,
checkpoints, and the drafter and verifier engines built on them. No gRPC, no Redis: it imports
neither the platform nor a service.
"""
