"""An NSQ-compatible broker over FDQ: real NSQ clients (pynsq, nsqjs, go-nsq ...)
publish to and consume from FDQ unchanged.

* ``protocol.py``: nsqd's TCP protocol V2 (and youzan's PUB_EXT), a pure codec.
* ``server.py``: the asyncio server (``Broker``, ``serve``, ``run``).
* ``http.py``: nsqd's HTTP API and ``/metrics``.
* ``auth.py``: ``--auth-file`` secrets and permissions.

Run it with ``python -m fdq.broker --url sqlite:///path/db --tcp-address 127.0.0.1:4150
--http-address 127.0.0.1:4151`` (nsqd's flag names; see ``--help``), or from Python with
``fdq.broker.server.run(url, tcp_address, http_address, options)``.
"""
