"""The specpass torch.compile backend, lowerings, and the decode loop."""
