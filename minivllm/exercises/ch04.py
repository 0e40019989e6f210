"""Chapter 4 exercises."""

from minivllm.exercises import exercise, expect


@exercise("04.slot_states")
def _slot_states():
    def case(running, budget, want):
        def test(slot_states):
            got = slot_states(list(running), budget)
            got = {key: got.get(key) for key in want} if isinstance(got, dict) else got
            expect(got == want, f"slot_states({running}, {budget}) = {got}, expected {want}")
        return test

    return [
        ("one request, just admitted", case([(64, 10, 40)], 100,
                                            dict(token_states=10, reservation=30, internal=24, free=36))),
        ("an oracle reservation has no internal fragmentation", case([(40, 25, 40)], 40,
                                                                     dict(token_states=25, reservation=15, internal=0,
                                                                          free=0))),
        ("several requests", case([(2048, 300, 500), (128, 100, 128), (32, 31, 32)], 4096,
                                  dict(token_states=431, reservation=229, internal=1548, free=1888))),
        ("an empty server is all free", case([], 512, dict(token_states=0, reservation=0, internal=0, free=512))),
    ]


@exercise("04.best_fit")
def _best_fit():
    def case(allocations, size, capacity, want):
        def test(best_fit):
            got = best_fit(list(allocations), size, capacity)
            expect(got == want, f"best_fit({allocations}, {size}, {capacity}) = {got}, expected {want}")
        return test

    return [
        ("the free memory after one allocation", case([(0, 10)], 5, 100, 10)),
        ("the smallest gap that fits, not the first", case([(0, 5), (20, 30), (34, 50)], 4, 100, 30)),
        ("an exact fit wins", case([(10, 20), (25, 60)], 5, 64, 20)),
        ("the tail counts as a gap", case([(0, 50), (60, 95)], 5, 100, 95)),
        ("ties go to the lowest start", case([(0, 5), (10, 15), (20, 30)], 5, 30, 5)),
        ("nothing fits", case([(0, 40), (45, 90)], 6, 95, None)),
        ("a gap one slot too small", case([(0, 10), (15, 20)], 6, 20, None)),
    ]
