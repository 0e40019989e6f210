"""A claim the prose makes about a measurement, checked in the cell that measures it: the cell prints the
claim with its evidence, and raises when this run's numbers disagree, so that a re-execution which
contradicts the prose fails the notebook tests instead of reaching a reader."""


def claim(holds: bool, statement: str) -> None:
    """Print `✓ statement` when the measurement supports it; raise AssertionError naming it otherwise."""
    if not holds:
        raise AssertionError(f"✗ the prose claims: {statement}. This run's measurement disagrees.")
    print(f"✓ {statement}")
