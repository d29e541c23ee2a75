"""What several transports share: memory views, the control channel, staging, status and descriptors."""
