"""The worker base: the process every worker runs, the Worker and TensorStore services, the engine flags."""
