"""The coordinator: a torch.compile backend that serves eagerly and swaps in compiled tiers.

Importing this package does not import torch; its modules do.
"""
