"""The service platform: settings, the gRPC server and its error mapping, TLS, metrics, health
checks, membership and the Redis store. No model and no torch here; it imports no service.
"""
