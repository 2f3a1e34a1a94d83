"""The worker's training session: checkpoints (and, next, the session and its hooks)."""
