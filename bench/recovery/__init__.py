"""How long a whole-node crash leaves a one-replica deployment without service."""
