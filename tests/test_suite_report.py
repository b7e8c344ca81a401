"""What a green run says about the proofs it did not run: a test skipped for a missing CPU piece the README
promises (oneDNN, the int4 kernel, a C++ compiler) is counted apart in the summary line and listed with
the piece (tests/conftest.py); GPU-only tests stay plain skips."""

import os
import subprocess
import sys
import textwrap

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_a_missing_cpu_piece_shows_in_the_summary_line(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("suite_conftest", {os.path.join(TESTS, "conftest.py")!r})
        suite = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(suite)  # the suite's own hooks, under this folder's conftest
        CPU_PIECE_MISSING = suite.CPU_PIECE_MISSING
        pytest_report_teststatus, pytest_terminal_summary = suite.pytest_report_teststatus, suite.pytest_terminal_summary
    """))
    (tmp_path / "test_pieces.py").write_text(textwrap.dedent("""
        import os

        import pytest
        from conftest import CPU_PIECE_MISSING

        # the outer test runs this file with neither piece present (the env names what the "machine" has)
        @pytest.mark.skipif("FROBNICATOR" not in os.environ, reason=f"{CPU_PIECE_MISSING}: this machine has no frobnicator")
        def test_needs_a_piece():
            pass

        @pytest.mark.skipif("FAKE_CUDA_DEVICE" not in os.environ, reason="needs a CUDA device")
        def test_needs_a_gpu():
            pass

        def test_runs():
            pass
    """))
    env = {k: v for k, v in os.environ.items() if k not in ("FROBNICATOR", "FAKE_CUDA_DEVICE")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert "1 passed" in summary and "1 skipped: a CPU piece missing" in summary and ", 1 skipped" in summary
    assert "1 test: this machine has no frobnicator" in done.stdout
