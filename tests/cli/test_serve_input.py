"""`reflow serve` refuses a bad --host, --port or --api-url with exit 2 before it starts anything."""

from __future__ import annotations

import socket

import pytest

from reflow.cli import main as cli
from reflow.cli.serve import port_in_use


@pytest.mark.parametrize("args,needle", [
    (["--host", "999.1.1.1", "--port", "4999"], "--host '999.1.1.1': not an address or host name"),
    (["--host", "192.0.2.1", "--port", "4999"], "--host '192.0.2.1': not an address of this machine"),
    (["--api-url", "notaurl"], "--api-url 'notaurl': expected"),
    (["--api-url", "ftp://host/api"], "--api-url 'ftp://host/api': expected"),
])
def test_a_bad_host_or_api_url_exits_2_naming_it(args: list[str], needle: str, tmp_path, capsys) -> None:
    assert cli.main(["serve", *args, "--runs", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert needle in err and "in use" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_port_with_a_listener_is_in_use_and_a_free_one_is_not() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert port_in_use("127.0.0.1", port)
    assert not port_in_use("127.0.0.1", port)
