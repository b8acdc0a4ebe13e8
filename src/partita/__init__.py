"""partita: parallel training for transformer language models on torch.distributed."""

__version__ = "0.1.0"
