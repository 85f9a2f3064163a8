"""Which tier serves: the ladder's start points and adoptions, the gate's pure decision, and the
fleet vote that lets one replica measure for all.
"""
