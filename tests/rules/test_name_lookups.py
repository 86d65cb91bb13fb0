"""Slow name resolution, named (``base/names.py``): c10d resolves the store's name on every connection and its
server looks every client's address up; where the DNS server never answers, each costs the resolver's timeout.
The ssh host checks and ``doctor`` time both directions and say which is slow, where, and the fix; the ssh head
gives the ranks the store's address, not its name, where every host resolved it alike. Resolution is faked here
(a resolver that answers late), the rest is the launcher's own."""

import re
import socket
import time

import pytest

from launcher.base import names
from launcher.launch.ssh.host_check import HostFacts
from launcher.launch.ssh.hosts import as_address

ADDRESSES = {
    "fast": "10.0.0.1",
    "slowname": "10.0.0.2",
    "stuck": "10.0.0.3",
    "slowback": "10.0.0.4",
    "mappedslow": "10.0.0.5",
}


@pytest.fixture
def resolver(monkeypatch):
    """``slowname`` resolves in 1.2 s, ``stuck`` never within the test's limit (3 s), ``slowback``'s address looks
    back in 1.2 s, ``mappedslow``'s in its IPv4-mapped form only (an /etc/hosts with IPv4 lines: a dual-stack store
    server's look-up of an IPv4 peer asks DNS); everything else at once. (Sleeps stand in for a DNS server that
    answers late.)"""

    def getaddrinfo(name, *args, **kwargs):
        time.sleep({"slowname": 1.2, "stuck": 30}.get(name, 0))
        if name not in ADDRESSES:
            raise socket.gaierror(-2, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ADDRESSES[name], 0))]

    def getnameinfo(sockaddr, flags):
        addr = sockaddr[0].removeprefix("::ffff:")
        slow = addr == ADDRESSES["slowback"] or sockaddr[0] == "::ffff:" + ADDRESSES["mappedslow"]
        time.sleep(1.2 if slow else 0)
        return next(n for n, a in ADDRESSES.items() if a == addr), "0"

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "getnameinfo", getnameinfo)


def test_each_name_both_ways_timed_at_once_and_the_slow_ones_said_with_the_fix(resolver):
    started = time.monotonic()
    lookups = names.time_lookups(["fast", "slowname", "stuck", "slowback", "nosuch", "mappedslow", "fast"], 3.0)
    took = time.monotonic() - started
    assert took < 4.5, f"{took:.1f} s: the look-ups ran one after another, or the stuck one was waited for"
    got = {(x.kind, x.what): x for x in lookups}
    assert set(got) == {
        ("forward", "fast"), ("reverse", "10.0.0.1"), ("reverse", "::ffff:10.0.0.1"),
        ("forward", "slowname"), ("reverse", "10.0.0.2"), ("reverse", "::ffff:10.0.0.2"),
        ("forward", "stuck"),
        ("forward", "slowback"), ("reverse", "10.0.0.4"), ("reverse", "::ffff:10.0.0.4"),
        ("forward", "nosuch"),
        ("forward", "mappedslow"), ("reverse", "10.0.0.5"), ("reverse", "::ffff:10.0.0.5"),
    }  # fmt: skip
    assert got[("forward", "nosuch")].answer is None and got[("forward", "nosuch")].seconds < 1  # fast: harmless
    assert got[("forward", "stuck")].seconds == 3.0 and got[("forward", "stuck")].answer is None
    slow = sorted((x.kind, x.what) for x in names.slow_lookups(lookups))
    expected = [("forward", "slowname"), ("forward", "stuck"), ("reverse", "10.0.0.4")]
    assert slow == [*expected, ("reverse", "::ffff:10.0.0.4"), ("reverse", "::ffff:10.0.0.5")], slow
    assert (
        got[("forward", "slowname")]
        .said("vm2")
        .startswith(
            "on vm2, resolving slowname takes 1.2 s; HINT: put slowname's address in vm2's /etc/hosts, or give "
            "cluster.master_addr as an address"
        )
    )
    assert got[("forward", "stuck")].said("vm2").startswith("on vm2, resolving stuck takes more than 3 s")
    assert got[("reverse", "10.0.0.4")].said("vm1") == (
        "on vm1, a reverse look-up of 10.0.0.4 takes 1.2 s (c10d makes one per connection); HINT: name 10.0.0.4 in "
        "vm1's /etc/hosts (a line '10.0.0.4 <its name>')"
    )
    own = names.Lookup("forward", "vm1", 12.0, None, finished=False).said("vm1")  # (torch's agent, gloo)
    assert own == (
        "on vm1, resolving its own name vm1 takes more than 12 s (torch resolves it); HINT: a line '<its address> vm1' "
        "in its /etc/hosts"
    )


def test_an_address_given_is_looked_up_in_reverse_only(resolver):
    lookups = names.time_lookups(["10.0.0.4"], limit_s=3.0)
    assert [(x.kind, x.what, x.answer) for x in lookups] == [("reverse", "10.0.0.4", "slowback")]


def facts(master_ip, slow=()):
    return HostFacts("vm", "10.0.0.9", "10.0.0.8", 0.0, None, 0, False, [], master_ip, list(slow))


def test_the_store_is_reached_at_the_address_every_host_resolved_its_name_to():
    assert as_address("vm1", [facts("10.0.0.1"), facts("10.0.0.1")]) == "10.0.0.1"
    assert as_address("vm1", [facts("10.0.0.1"), facts("10.1.0.1")]) == "vm1"  # seen differently: the name
    assert as_address("vm1", [facts("10.0.0.1"), facts("")]) == "vm1"  # (unresolved somewhere: refused earlier)


def test_the_host_check_reports_its_slow_lookups(resolver, monkeypatch, tmp_path):
    from launcher.base.run_dir import RunDir
    from launcher.launch.ssh import host_check

    monkeypatch.setattr(names, "LOOKUP_LIMIT_S", 3.0)
    monkeypatch.setattr(host_check, "time_lookups", lambda found: names.time_lookups(found, limit_s=3.0))
    monkeypatch.setattr(socket, "gethostbyname", lambda name: ADDRESSES[name])
    monkeypatch.setattr(socket, "gethostname", lambda: "vm1")
    RunDir(str(tmp_path)).host_check("t").write_text("t")
    found = host_check.check_this_host(str(tmp_path), "t", "fast", "-", "fast,slowname")
    assert found.master_ip == "10.0.0.1" and not found.problems, found
    assert found.slow_lookups == [
        "on vm1, resolving slowname takes 1.2 s; HINT: put slowname's address in vm1's /etc/hosts, or give "
        "cluster.master_addr as an address"
    ], found.slow_lookups


def test_the_host_check_names_a_slow_reverse_lookup(resolver, monkeypatch, tmp_path):
    """Every forward look-up is fast here: only the reverse look-ups of ``slowback``'s address (as itself and
    IPv4-mapped, as a dual-stack store server sees it) are slow, and the host check says both."""
    from launcher.base.run_dir import RunDir
    from launcher.launch.ssh import host_check

    monkeypatch.setattr(host_check, "time_lookups", lambda found: names.time_lookups(found, limit_s=3.0))
    monkeypatch.setattr(socket, "gethostbyname", lambda name: ADDRESSES[name])
    monkeypatch.setattr(socket, "gethostname", lambda: "vm1")
    RunDir(str(tmp_path)).host_check("t").write_text("t")
    found = host_check.check_this_host(str(tmp_path), "t", "fast", "-", "fast,slowback")
    assert found.master_ip == "10.0.0.1" and not found.problems, found
    said = sorted(re.sub(r"takes 1\.\d s", "takes 1.x s", line) for line in found.slow_lookups)  # (1.2 s: a busy box)
    assert said == [
        f"on vm1, a reverse look-up of {addr} takes 1.x s (c10d makes one per connection); HINT: name {addr} in "
        f"vm1's /etc/hosts (a line '{addr} <its name>')"
        for addr in ("10.0.0.4", "::ffff:10.0.0.4")
    ], found.slow_lookups
