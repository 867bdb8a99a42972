"""`CompiledLaunches`: the first call of a key goes through the JIT, the next ones call the compiled kernel with every
argument in signature order (positional, by name, defaults), without the JIT's options; a new key, or an int
argument past i32's range, compiles again. The Gluon forward's GPU tests run it on the real kernel."""
from ioattn.ops.compiled_launch import CompiledLaunches


class FakeCompiled:
    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def __getitem__(self, grid):
        return lambda *args: self.calls.append((self.name, grid, args))


class FakeJit:
    """Stands for a `triton.jit` function: `fn` carries the signature, `[grid](...)` compiles and launches."""

    def __init__(self):
        self.calls, self.compiled = [], 0

        def kernel(x_ptr, n, scale, BLOCK, Y=None, stride=0, FLAG=False):
            pass

        self.fn = kernel

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.compiled += 1
            self.calls.append(("jit", grid, args, kwargs))
            return FakeCompiled(self.calls, f"compiled{self.compiled}")
        return run


def test_second_call_of_a_key_launches_the_compiled_kernel_with_arguments_in_signature_order():
    jit = FakeJit()
    launches = CompiledLaunches(jit)
    launches("a", (4,), "x", 10, 0.5, BLOCK=64, num_warps=4, maxnreg=128)
    assert jit.compiled == 1 and jit.calls[-1] == ("jit", (4,), ("x", 10, 0.5), dict(BLOCK=64, num_warps=4,
                                                                                      maxnreg=128))
    launches("a", (8,), "x2", 11, 0.25, BLOCK=64, num_warps=4, maxnreg=128)
    assert jit.compiled == 1
    assert jit.calls[-1] == ("compiled1", (8, 1, 1), ("x2", 11, 0.25, 64, None, 0, False))
    launches("a", (3, 2), "x3", 12, 1.0, BLOCK=64, stride=7, Y="y", FLAG=False, num_warps=4)
    assert jit.calls[-1] == ("compiled1", (3, 2, 1), ("x3", 12, 1.0, 64, "y", 7, False))
    launches("b", (4,), "x", 10, 0.5, BLOCK=128, FLAG=True)  # another specialization
    assert jit.compiled == 2 and len(launches) == 2
    launches("b", (4,), "x", 2**31, 0.5, BLOCK=128, FLAG=True)  # n passed as i64: compiled again
    launches("b", (4,), "x", 2**32, 0.5, BLOCK=128, FLAG=True)
    assert jit.compiled == 3 and jit.calls[-1] == ("compiled3", (4, 1, 1), ("x", 2**32, 0.5, 128, None, 0, True))
    launches("b", (4,), "x", -2**31, 0.5, BLOCK=128, FLAG=True)  # i32's range includes -2**31
    assert jit.compiled == 3 and jit.calls[-1][0] == "compiled2"
