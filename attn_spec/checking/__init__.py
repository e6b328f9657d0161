"""How it is checked: cases and their Hypothesis strategies, black-box probes, the error budgets,
the property registry (``catalog``), the assertions every property fails through, the diagnoses,
and the runner that turns properties into verdicts."""
