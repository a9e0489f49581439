"""What runs in a worker beside the task: the worker step, the renewer and its
watches, and freeing what a dead child or a revoked message held."""
