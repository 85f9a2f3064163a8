"""A graph made shippable: its inputs as metadata, the graph node for node, call targets by
reference, cache keys, and the plain-value wire forms of every job and reply.
"""
