"""Plain PyTorch models. They know nothing of distribution: parallelism is applied from outside."""
