"""``--https-address``: the broker's HTTP API (nsqd's /pub, /stats, ...) over TLS with
``--tls-cert/--tls-key``, beside the plain HTTP address."""
import json
import os
import ssl
import subprocess
import sys
import urllib.request

import pytest

from fdqtest import readline_within

FDQ = os.path.join(os.path.dirname(sys.executable), "fdq")


def tls_context(cert):
    ctx = ssl.create_default_context(cafile=cert)     # the broker's own certificate, verified
    ctx.check_hostname = False                        # (issued to CN=127.0.0.1, no subjectAltName)
    return ctx


def request(url, cert, body=None):
    req = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET")
    with urllib.request.urlopen(req, timeout=30, context=tls_context(cert)) as r:
        return r.status, r.read()


def test_https_serves_the_http_api_over_tls(broker_factory, cert):
    crt, key = cert
    b = broker_factory("--tls-cert", crt, "--tls-key", key, "--https-address", "127.0.0.1:0")
    assert b.https and b.https != b.http
    assert request(f"https://{b.https}/ping", crt) == (200, b"OK")
    assert request(f"https://{b.https}/pub?topic=secure", crt, b"one")[0] == 200
    assert request(f"https://{b.https}/mpub?topic=secure", crt, b"two\nthree")[0] == 200
    st = json.loads(request(f"https://{b.https}/stats?format=json&topic=secure", crt)[1])
    assert st["topics"][0]["message_count"] == 3 and st["topics"][0]["depth"] == 3
    assert json.loads(b.http_req("/stats?format=json&topic=secure")[1])["topics"][0]["message_count"] == 3
    with pytest.raises((urllib.error.URLError, ConnectionError)):     # plain HTTP on the HTTPS port: no answer
        urllib.request.urlopen(f"http://{b.https}/ping", timeout=10)


def test_fdq_broker_prints_the_https_address(db_url, cert):
    crt, key = cert
    proc = subprocess.Popen([FDQ, "--url", db_url, "broker", "--tcp-address", "127.0.0.1:0", "--http-address",
                             "127.0.0.1:0", "--tls-cert", crt, "--tls-key", key, "--https-address", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)   # it prints on stderr
    try:
        line = ""
        for _ in range(20):
            line = readline_within(proc, 60, "the listening line")
            if "listening" in line:
                break
        https = line.split("https=")[1].split()[0]
        assert request(f"https://{https}/ping", crt) == (200, b"OK")
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stdout.close()
    assert proc.returncode == 0


def test_https_address_needs_a_certificate(db_url):
    out = subprocess.run([FDQ, "--url", db_url, "broker", "--tcp-address", "127.0.0.1:0",
                          "--https-address", "127.0.0.1:0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--https-address needs --tls-cert" in out.stderr, out.stderr
