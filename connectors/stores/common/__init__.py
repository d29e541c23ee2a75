"""What several stores share: keys, the host page pool, eviction order, remote records, backoff."""
