"""Chapter 2 exercises."""


from minivllm.exercises import exercise, expect

@exercise("02.linear_intensity")
def _linear_intensity():
    def reference(tokens, d_in, d_out, bytes_per_element):
        flops = 2 * tokens * d_in * d_out
        moved = bytes_per_element * (d_in * d_out + tokens * d_in + tokens * d_out)
        return flops / moved

    def case(*args):
        def test(linear_intensity):
            got, want = float(linear_intensity(*args)), reference(*args)
            expect(abs(got - want) <= 1e-6 * want, f"linear_intensity{args} = {got:.4f}, expected {want:.4f}")
        return test

    return [
        ("decode: one token, fp32", case(1, 4096, 4096, 4)),
        ("decode: one token, bf16", case(1, 4096, 11008, 2)),
        ("prefill: 512 tokens", case(512, 4096, 4096, 2)),
        ("a batch of 64 decodes", case(64, 1024, 3072, 2)),
    ]


@exercise("02.ttft_tpot")
def _ttft_tpot():
    def case(arrival, token_times, want):
        def test(ttft_tpot):
            got = ttft_tpot(arrival, list(token_times))
            expect(len(got) == 2, "return (ttft, tpot)")
            ok = all((g is None and w is None) or (g is not None and w is not None and abs(g - w) < 1e-9)
                     for g, w in zip(got, want))
            expect(ok, f"ttft_tpot({arrival}, {token_times}) = {got}, expected {want}")
        return test

    return [
        ("evenly spaced tokens", case(10.0, [10.5, 10.6, 10.7, 10.8], (0.5, 0.1))),
        ("uneven decode steps", case(0.0, [2.0, 3.0, 3.5, 6.0], (2.0, 4.0 / 3))),
        ("two tokens", case(1.0, [1.25, 2.0], (0.25, 0.75))),
        ("a single token has no TPOT", case(5.0, [7.0], (2.0, None))),
    ]
