import os
import tempfile

os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "attn-spec-hypothesis"))


def pytest_terminal_summary(terminalreporter):
    """Print the gallery's mutation score and false-alarm count after the run."""
    import sys

    module = sys.modules.get("test_gallery")
    if module is None or not (module.KILLS or module.ALARMS):
        return
    kills, alarms = module.KILLS, module.ALARMS
    false_alarms = sorted(name for name, failed in alarms.items() if failed)
    terminalreporter.write_sep("=", "attention gallery")
    terminalreporter.write_line(f"mutation score: {sum(kills.values())}/{len(kills)} buggy attentions killed"
                                + (f" (survivors: {', '.join(n for n, k in kills.items() if not k)})"
                                   if not all(kills.values()) else ""))
    terminalreporter.write_line(f"false alarms: {len(false_alarms)} of {len(alarms)} correct variants"
                                + (f" ({', '.join(false_alarms)})" if false_alarms else ""))
