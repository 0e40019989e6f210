"""Wrong answers to the book's exercises (one module per chapter), and the right ones taken from the
solutions notebooks, for tests/test_wrong_solutions.py."""
