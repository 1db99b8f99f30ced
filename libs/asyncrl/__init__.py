"""asyncrl: asynchronous RL post-training for language models, as gRPC microservices."""

__version__ = "0.1.0"
