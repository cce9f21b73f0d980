"""Script text for tests that count numba compiles per thread in a fresh process: paste ``COUNT_COMPILES`` into
the child's script after ``import threading`` and ``from onnx_runtime_ep_cpu.compiled import deferred``; the child
then reads ``compiles["main"]`` (compiles on the thread that imported it) and ``compiles["other"]``."""

COUNT_COMPILES = r"""
main = threading.get_ident()
compiles = {"main": 0, "other": 0}

def count_compiles():  # every real compile in this process (cache loads are not compiles)
    from numba.core import compiler
    original = compiler.compile_extra

    def counted(*args, **kwargs):
        compiles["main" if threading.get_ident() == main else "other"] += 1
        return original(*args, **kwargs)
    compiler.compile_extra = counted

real_ensure = deferred.ensure_numba
def ensure():
    real_ensure()
    if not ensure.done:
        ensure.done = True
        count_compiles()
ensure.done = False
deferred.ensure_numba = ensure
"""
