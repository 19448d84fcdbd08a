"""Issue 24 item 9: hostile flags, config files and environment are usage errors, never 3.

Unicode digits in --listen (and in the config's listen), a config nested thousands deep and
a daemon URL with an unclosed IPv6 bracket used to end in "internal error" (exit 3).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.host import EnvFactory, run_gpudiag


@pytest.mark.parametrize("listen", ["127.0.0.1:\u00b2", "127.0.0.1:\u0663", "[::1]:\uff19"])
def test_unicode_digits_in_listen_are_exit_2(listen: str, tmp_path: Path) -> None:
    proc = run_gpudiag(["serve", "--listen", listen, "--check-config"], {"PATH": "/usr/bin"})
    assert proc.returncode == 2 and "is not 0-65535" in proc.stderr, proc.stderr
    config = tmp_path / "daemon.toml"
    config.write_text(f'listen = "{listen}"\n', encoding="utf-8")
    proc = run_gpudiag(["serve", "--config", str(config), "--check-config"], {"PATH": "/usr/bin"})
    assert proc.returncode == 2 and "is not 0-65535" in proc.stderr, proc.stderr


@pytest.mark.parametrize("nested", ["a = " + "[" * 3000 + "]" * 3000,
                                    "a = " + "{b=" * 3000 + "1" + "}" * 3000])
def test_a_config_nested_thousands_deep_is_exit_2(nested: str, tmp_path: Path) -> None:
    config = tmp_path / "deep.toml"
    config.write_text(nested + "\n")
    proc = run_gpudiag(["serve", "--config", str(config), "--check-config"], {"PATH": "/usr/bin"})
    assert proc.returncode == 2 and "nested too deeply" in proc.stderr, proc.stderr
    assert "internal error" not in proc.stderr


@pytest.mark.parametrize("url", ["http://[::1", "http://[::1]:\u00b2", "http://host:99999999"])
def test_a_daemon_url_that_is_no_url_is_a_usage_error(gpu_env: EnvFactory, url: str,
                                                      tmp_path: Path) -> None:
    env = gpu_env(GPUDIAG_DAEMON_URL=url)
    proc = run_gpudiag(["preflight"], env)
    assert proc.returncode == 2 and "is not understood" in proc.stderr, proc.stderr
    proc = run_gpudiag(["run", "--artifacts", str(tmp_path / "a"), "--", "true"], env)
    assert proc.returncode == 125 and "is not understood" in proc.stderr, proc.stderr
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr
