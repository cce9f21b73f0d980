"""The algorithms the operators run, the choice between them, and how their work is split across threads.

ops/ defines the operators (attributes, validation, registration: one family per module); each of its
kernels calls into here, and the code here calls the compiled loops of compiled/. The sizes at which an
algorithm or a split changes are the knobs of tuning.py.
"""
