"""The router's HTTP: client connections and requests in, the lean client and relay out to the workers."""
