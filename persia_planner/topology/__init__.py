"""Where tables can go: the cluster graph, its hardware, topology.yaml and torchrun's nodes."""
