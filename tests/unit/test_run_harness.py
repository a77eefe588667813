"""``fakes.fleet.run_harness``: the harnesses' shared ``__main__`` exit (main's code; 130 on Ctrl-C)."""

from __future__ import annotations

import pytest

from fakes.fleet import run_harness


def test_exits_with_the_code_of_main() -> None:
    with pytest.raises(SystemExit) as e:
        run_harness(lambda: 2)
    assert e.value.code == 2


def test_ctrl_c_says_interrupted_and_exits_130(capsys: pytest.CaptureFixture[str]) -> None:
    def main() -> int:
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as e:
        run_harness(main)
    assert e.value.code == 130
    assert capsys.readouterr().err == "interrupted\n"
