"""Where a tier comes from: the cache, a worker (through an executor), inductor in this process,
or a call that serves the graph when its artifact cannot be saved.
"""
