"""trainer-svc: the actor. Holds the training model, publishes its weights over the weight bus.

Importing this package must not import megatron-core or torch's CUDA; backends import
megatron lazily inside the functions that build models.
"""
