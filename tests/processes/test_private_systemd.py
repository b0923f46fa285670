"""The private systemd the tests boot (tests/support/systemd.py) keeps its hands off everyone else's files.

At boot, systemd-tmpfiles removes every ``/var/tmp/systemd-private-*`` (``R!`` in systemd-tmp.conf): the
PrivateTmp directories of the units running elsewhere. Under `make test` several namespaces boot at once;
while they shared the host's /var/tmp, one booting removed the PrivateTmp of a unit running in another (and on
the host), and that unit's next ExecReload failed at its NAMESPACE step (226) — the installer test's
`systemctl reload` failed that way in CI. Each namespace now has its own /var/tmp.
"""

from __future__ import annotations

from harness import required
from tests.support import systemd as systemd_support

HELD = """[Service]
PrivateTmp=yes
ExecStart=/bin/sleep infinity
ExecReload=/bin/true
"""


def test_a_booting_namespace_leaves_the_private_tmp_of_units_in_another_alone() -> None:
    required.need(systemd_support.skip_reason(), "a real systemd")
    with systemd_support.PrivateSystemd() as first:
        first.install_unit("held.service", HELD)
        first.systemctl("daemon-reload")
        first.systemctl("start", "held.service")
        assert first.systemctl("reload", "held.service", check=False).returncode == 0  # it can, to begin with
        with systemd_support.PrivateSystemd() as second:
            # the boot step that removes /var/tmp/systemd-private-* ran there
            cleaned = second.systemctl("show", "-p", "ActiveState", "--value", "systemd-tmpfiles-setup.service")
            assert cleaned.stdout.strip() == "active"
            # the shared directory is still the same directory on both sides
            (second.shared_dir / "probe").write_text("seen")
            assert second.run("cat", str(second.shared_dir / "probe")).stdout == "seen"
        reload = first.systemctl("reload", "held.service", check=False)
        assert reload.returncode == 0, reload.stderr + first.run("journalctl", "--no-pager", "-u", "held.service").stdout
