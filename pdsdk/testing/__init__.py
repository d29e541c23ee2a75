"""pdsdk.testing: the public test kit (like pytest's pytester), kept apart from the product.

Fake and lean workers, fake KV event streams, peer and store-server drivers and fault injection, used by
pdsdk's own tests and benchmarks and by anyone testing a plugin. Nothing here is imported by the serving path.
"""
