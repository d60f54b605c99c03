"""The speculative algorithms: token trees and their contracts, fusion of drafter proposals,
the acceptance rules, lookup drafting. No gRPC, no Redis: it imports neither the platform nor a service.
"""
