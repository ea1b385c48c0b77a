"""The training engine: one loop for any model, loss, optimizer and dataset."""
