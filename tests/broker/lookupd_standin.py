"""A small nsqlookupd stand-in (asyncio, in a thread of the test process): lookupd's TCP
protocol V1 as nsqlookupd 1.3.0's ``lookup_protocol_v1.go`` speaks it (magic, IDENTIFY
with its field checks, REGISTER/UNREGISTER/PING, fatal ``E_*`` errors that close the
connection; a producer's registrations vanish with its connection) and its HTTP
``/lookup``, ``/topics``, ``/nodes``, ``/ping``."""
import asyncio
import json
import re
import struct
import threading
import time
import urllib.parse

VALID = re.compile(r"^[.a-zA-Z0-9_-]+(#ephemeral)?$")


def _valid(name):
    return 0 < len(name) <= 64 and VALID.match(name) is not None


class Producer:
    def __init__(self, remote):
        self.remote = remote
        self.info = None
        self.regs = set()       # (topic, channel or "")


class LookupdStandin:
    def __init__(self):
        self.producers = {}     # id -> Producer (connected and identified)
        self.log = []           # (time, remote, command line)
        self.loop = None
        self.tcp_port = self.http_port = None
        self._servers = []
        self._conns = set()
        self._thread = None

    # -- life --------------------------------------------------------------------------

    def start(self, tcp_port=0, http_port=0):
        ready = threading.Event()

        def main():
            self.loop = asyncio.new_event_loop()
            self.loop.run_until_complete(self._start(tcp_port, http_port))
            ready.set()
            self.loop.run_forever()
            self.loop.close()
        self._thread = threading.Thread(target=main, daemon=True)
        self._thread.start()
        assert ready.wait(10), "the lookupd stand-in did not start"
        return self

    async def _start(self, tcp_port, http_port):
        tcp = await asyncio.start_server(self._tcp, "127.0.0.1", tcp_port)
        http = await asyncio.start_server(self._http, "127.0.0.1", http_port)
        self._servers = [tcp, http]
        self.tcp_port = tcp.sockets[0].getsockname()[1]
        self.http_port = http.sockets[0].getsockname()[1]

    def stop(self):
        """Close the listeners and every connection (a lookupd killed)."""
        async def _stop():
            for s in self._servers:
                s.close()
            for w in list(self._conns):
                w.close()
            self.producers.clear()
        asyncio.run_coroutine_threadsafe(_stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    @property
    def tcp(self):
        return f"127.0.0.1:{self.tcp_port}"

    @property
    def http(self):
        return f"127.0.0.1:{self.http_port}"

    # -- state, read from the tests' thread ----------------------------------------------

    def call(self, fn):
        async def run():
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def registrations(self):
        """{(broadcast_address, tcp_port): set of (topic, channel)}"""
        return self.call(lambda: {(p.info["broadcast_address"], p.info["tcp_port"]): set(p.regs)
                                  for p in self.producers.values()})

    def lines(self):
        return self.call(lambda: [line for _t, _r, line in self.log])

    # -- TCP V1 --------------------------------------------------------------------------

    async def _tcp(self, reader, writer):
        self._conns.add(writer)
        remote = "%s:%d" % writer.get_extra_info("peername")[:2]
        prod = Producer(remote)
        key = id(prod)

        def answer(data):
            writer.write(struct.pack(">I", len(data)) + data)
        try:
            if await reader.readexactly(4) != b"  V1":
                answer(b"E_BAD_PROTOCOL bad magic")
                return
            while True:
                line = (await reader.readline()).decode()
                if not line:
                    return
                parts = line.strip().split(" ")
                self.log.append((time.monotonic(), remote, line.strip()))
                verb = parts[0]
                if verb == "PING":
                    answer(b"OK")
                elif verb == "IDENTIFY":
                    if prod.info is not None:
                        answer(b"E_INVALID cannot IDENTIFY again")
                        return
                    size = struct.unpack(">I", await reader.readexactly(4))[0]
                    info = json.loads(await reader.readexactly(size))
                    if not info.get("broadcast_address") or not info.get("tcp_port") \
                            or not info.get("http_port") or not info.get("version"):
                        answer(b"E_BAD_BODY IDENTIFY missing fields")
                        return
                    prod.info = info
                    self.producers[key] = prod
                    answer(json.dumps({"tcp_port": self.tcp_port, "http_port": self.http_port,
                                       "version": "1.3.0", "broadcast_address": "127.0.0.1",
                                       "hostname": "standin"}).encode())
                elif verb in ("REGISTER", "UNREGISTER"):
                    if prod.info is None:
                        answer(b"E_INVALID client must IDENTIFY")
                        return
                    if len(parts) < 2 or not _valid(parts[1]):
                        answer(b"E_BAD_TOPIC %s topic name" % verb.encode())
                        return
                    topic, channel = parts[1], parts[2] if len(parts) > 2 else ""
                    if channel and not _valid(channel):
                        answer(b"E_BAD_CHANNEL %s channel name" % verb.encode())
                        return
                    if verb == "REGISTER":
                        prod.regs.update({(topic, ""), (topic, channel)})
                    elif channel:
                        prod.regs.discard((topic, channel))
                    else:
                        prod.regs = {r for r in prod.regs if r[0] != topic}
                    answer(b"OK")
                else:
                    answer(b"E_INVALID invalid command " + verb.encode())
                    return
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            self.producers.pop(key, None)
            self._conns.discard(writer)
            writer.close()

    # -- HTTP ----------------------------------------------------------------------------

    def _peers(self, topic=None):
        out = []
        for p in self.producers.values():
            if topic is None or (topic, "") in p.regs:
                i = p.info
                out.append({"remote_address": p.remote, "hostname": i.get("hostname"),
                            "broadcast_address": i["broadcast_address"], "tcp_port": i["tcp_port"],
                            "http_port": i["http_port"], "version": i["version"]})
        return out

    async def _http(self, reader, writer):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            target = head.split(b" ")[1].decode()
            url = urllib.parse.urlsplit(target)
            q = urllib.parse.parse_qs(url.query)
            status, body = 200, None
            if url.path == "/ping":
                body = b"OK"
            elif url.path == "/lookup":
                topic = (q.get("topic") or [""])[0]
                producers = self._peers(topic)
                if not producers:
                    status, body = 404, {"message": "TOPIC_NOT_FOUND"}
                else:
                    channels = sorted({c for p in self.producers.values() for t, c in p.regs
                                       if t == topic and c})
                    body = {"channels": channels, "producers": producers}
            elif url.path == "/topics":
                body = {"topics": sorted({t for p in self.producers.values() for t, _c in p.regs})}
            elif url.path == "/nodes":
                body = {"producers": self._peers()}
            else:
                status, body = 404, {"message": "NOT_FOUND"}
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            writer.write(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n" % (status, len(data)) + data)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, IndexError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()
