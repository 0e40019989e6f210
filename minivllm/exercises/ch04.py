"""Chapter 4 exercises."""

from minivllm.exercises import case_random, exercise, expect


@exercise("04.static_step")
def _static_step():
    from minivllm import SamplingParams, load_model
    from minivllm.book import static_batching
    from minivllm.book.texts import CORPUS
    from minivllm.exercises.harness import first_divergence, swapped, transformers_greedy

    model, tokenizer = load_model()
    corpus = tokenizer(CORPUS[:4000]).input_ids

    def case(spans, budgets, spare=0):
        """Prompts cut from the corpus at `spans`, greedy with `budgets` new tokens each, in rows of exactly
        the longest prompt plus its budget (plus `spare` slots)."""
        def test(static_step):
            prompts = [corpus[a:b] for a, b in spans]
            calls = []

            def reader_step(prompts_now, outputs, finished):
                calls.append(1)
                expect(len(calls) <= max(budgets) + 1, f"step {len(calls)}: the batch should have ended after "
                                                      f"{max(budgets)} steps (the largest budget)")
                answer = static_step([list(p) for p in prompts_now], [list(o) for o in outputs], list(finished))
                expect(isinstance(answer, tuple) and len(answer) == 3, "return (rows, new_tokens, num_cached)")
                rows, new_tokens, num_cached = (list(part) for part in answer)
                running = [i for i, done in enumerate(finished) if not done]
                expect(sorted(rows) == running, f"step {len(calls)}: rows {rows}, but the requests still running "
                                                f"are {running} (each in its own row: request i owns row i)")
                for i, tokens in zip(rows, new_tokens):
                    want, why = (1, "its last sampled token: the cache holds the rest") if outputs[i] else (
                        len(prompts_now[i]), "its prompt")
                    expect(len(tokens) == want, f"step {len(calls)}: request {i} brings {len(tokens)} tokens, "
                                                f"expected {want} ({why})")
                return rows, [list(t) for t in new_tokens], list(num_cached)

            params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in budgets]
            max_len = max(len(p) + n for p, n in zip(prompts, budgets)) + spare
            with swapped(static_batching, "static_step", reader_step):
                done = static_batching.generate_static_batch(model, prompts, params, tokenizer, max_len=max_len)
            expect(len(calls) == max(budgets), f"the batch took {len(calls)} steps; its longest request needs "
                                               f"{max(budgets)}")
            longest = transformers_greedy(prompts, max(budgets))
            problem = first_divergence([c.token_ids for c in done], [t[:n] for t, n in zip(longest, budgets)],
                                       prompts)
            expect(problem is None, problem)
        return test

    rng = case_random("04.static_step")
    drawn_spans = [(a, a + rng.randrange(1, 40)) for a in rng.sample(range(0, len(corpus) - 40, 7), rng.randrange(2, 6))]
    drawn_budgets = [rng.randrange(1, 12) for _ in drawn_spans]
    return [
        ("one request, rows of exactly its length", case([(0, 12)], [8])),
        ("requests that finish at different steps (budgets 1, 5 and 12)", case([(0, 9), (40, 60), (100, 104)],
                                                                               [1, 5, 12])),
        ("a one-token prompt beside a long one", case([(7, 8), (200, 250)], [6, 3])),
        ("the last request to finish is not the last in the batch", case([(300, 330), (400, 405), (500, 517)],
                                                                          [10, 2, 4], spare=3)),
        (f"random: {len(drawn_spans)} requests, budgets {drawn_budgets}", case(drawn_spans, drawn_budgets)),
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
