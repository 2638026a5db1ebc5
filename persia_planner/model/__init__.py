"""What is being placed: embedding tables, their access pattern and constraints, the dense network."""
