"""The context engine: what each model call sees, and keeping it within the window.

``assembly`` puts the sections together (pure); ``tokens`` sizes them and
knows the windows; ``compaction`` collapses the oldest turns into a durable
summary when a call would not fit; ``working_memory`` is the agent's
scratchpad; ``memory`` is where the soul and retrieved memory come from.
"""
