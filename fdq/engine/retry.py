"""The retry loop, once: :func:`transact`, and FDB's ``@transactional`` and a bounded
variant (:func:`run_within`) on it.

FoundationDB's rule (its developer guide: transaction retry loops): run the body in a
transaction, commit, and on an error ask ``tr.on_error``, which backs off and resets the
transaction for a retryable one and re-raises anything else. Two errors leave the outcome
open: ``commit_unknown_result`` (1021) and ``cluster_version_changed`` (1039) may have
committed, and a commit that timed out (1031) may have committed or may still be in
flight. A body that is not idempotent must know that an earlier attempt may have
committed; :class:`Attempt` tells it, and ``on_error`` lets its caller probe ("did it
commit?") or change course before the next attempt.
"""
from __future__ import annotations

import functools
import inspect
import time

from ..errors import EngineError, is_maybe_committed
from .binding import after_interrupt, check_process, describe, error_types, is_transaction


class Attempt:
    """What ``transact`` tells its body and its ``on_error`` hook about the attempts.

    * ``number``: 1 for the first attempt, then 2, 3, ...
    * ``maybe_committed``: an attempt may have committed (its commit raised 1021 or 1039,
      or timed out: 1031). In the body: an earlier attempt of this call; in ``on_error``:
      this one included.
    * ``in_flight``: such an attempt timed out during its commit, which may still apply.
    * ``result``: what the body of this attempt returned (None if it raised).
    * ``gave_up``: in ``on_error``, the :class:`~fdq.errors.EngineError` ``transact``
      would raise because the engine gave up on this error (not retryable, the retry
      limit, the timeout); None while it retries.
    """

    __slots__ = ("number", "maybe_committed", "in_flight", "result", "gave_up")

    def __init__(self):
        self.number = 1
        self.maybe_committed = False
        self.in_flight = False
        self.result = None
        self.gave_up = None

    def __repr__(self):
        return (f"Attempt(number={self.number}, maybe_committed={self.maybe_committed}, "
                f"in_flight={self.in_flight}, gave_up={self.gave_up!r})")


class Done:
    """``on_error``'s answer: stop, and ``transact`` returns ``value``."""

    __slots__ = ("value",)

    def __init__(self, value=None):
        self.value = value


class Again:
    """``on_error``'s answer: reset the transaction and run the body again at once (no
    backoff beyond the engine's, and even after an error the engine gave up on)."""

    __slots__ = ()


def _translate(e):
    """An FDB error leaving FDQ becomes an EngineError with the same code."""
    if isinstance(e, EngineError):
        return e
    return EngineError(e.code, describe(e) or None)


def retry_or_raise(tr, e):
    """One error of a retry loop: ``tr.on_error(e)`` (backoff and reset) or raise the
    final error as an EngineError. Every retry of :func:`transact` passes here. The
    engine is told the code only (FDB's binding takes no other error type); when it
    gives up on that code, ``e`` itself leaves, with its description (a full disk's
    cause, the damaged file), not a bare error of the same code."""
    try:
        tr.on_error(e.code).wait()
    except error_types() as final:
        if final is e or getattr(final, "code", None) == e.code:
            raise _translate(e) from None
        raise _translate(final) from e


def _no_generator(result):
    # As fdb.transactional at API >= 630: a lazy result would outlive its transaction.
    if inspect.isgenerator(result):
        raise ValueError("Generators can not be wrapped with fdq.transactional")
    return result


def transact(db, body, *, on_error=None, timeout_ms=None):
    """Run ``body(tr, attempt)`` in a new transaction of ``db`` and commit, retrying
    through ``tr.on_error`` as ``fdb.transactional`` does; return the body's result.

    ``on_error(e, attempt)``, if given, is called for every exception of the body or the
    commit, after the engine's decision (``attempt.gave_up``; for a retryable error the
    backoff is already waited and the transaction reset). It returns:

    * None: as usual: a retryable engine error is retried, a final one raised as
      :class:`~fdq.errors.EngineError`, any other exception raised as it is;
    * ``Done(value)``: stop and return ``value`` (say, a probe found that an attempt
      that may have committed did);
    * ``Again()``: reset the transaction and run the body again now.

    ``timeout_ms`` bounds the whole call (FDB's transaction timeout, which spans
    retries; an ``Again`` keeps what is left of it): past it, ``EngineError`` 1031.
    An interrupt (an exception that is not an ``Exception``) leaves through
    :func:`~fdq.engine.after_interrupt`. Raises :class:`~fdq.errors.ClientForked` for
    an FDB database in a process forked after its client started.
    """
    errors = error_types()
    check_process(db)
    tr = db.create_transaction()
    deadline = None
    if timeout_ms is not None:
        tr.options.set_timeout(int(timeout_ms))
        if timeout_ms > 0:
            deadline = time.monotonic() + timeout_ms / 1000
    attempt = Attempt()
    try:
        while True:
            committing = False
            attempt.result = None
            try:
                attempt.result = _no_generator(body(tr, attempt))
                committing = True
                tr.commit().wait()
                return attempt.result
            except Exception as e:
                error = e
            engine = isinstance(error, errors)
            if engine:
                code = getattr(error, "code", None)
                timed_out = committing and code == 1031
                if timed_out or is_maybe_committed(error):
                    attempt.maybe_committed = True
                    attempt.in_flight = attempt.in_flight or timed_out
                try:
                    retry_or_raise(tr, error)
                except EngineError as final:
                    attempt.gave_up = final
            answer = None if on_error is None else on_error(error, attempt)
            if answer is None:
                if not engine:
                    raise error
                if attempt.gave_up is not None:
                    raise attempt.gave_up
            elif isinstance(answer, Done):
                return answer.value
            elif isinstance(answer, Again):
                tr.reset()
                if timeout_ms is not None:
                    _restart_timeout(tr, timeout_ms, deadline)
            else:
                raise TypeError(f"on_error returned {answer!r}: None, Done(value) or Again()")
            attempt.gave_up = None
            attempt.number += 1
    except Exception:
        raise
    except BaseException:
        after_interrupt()
        raise


def _restart_timeout(tr, timeout_ms, deadline):
    """After ``reset()`` (which clears every option): what is left of the timeout."""
    if deadline is None:
        tr.options.set_timeout(int(timeout_ms))
        return
    left_ms = int((deadline - time.monotonic()) * 1000)
    if left_ms <= 0:
        raise EngineError(1031)
    tr.options.set_timeout(left_ms)


def transactional(func=None, *, parameter: str = "tr"):
    """As ``fdb.transactional``: called with a database, run ``func`` in a new
    transaction, commit, and retry through ``tr.on_error`` (:func:`transact`); called
    with a transaction (or its snapshot), run inside it without committing.

    The transaction must be passed positionally. Generators are refused (a lazy result
    would outlive its transaction). Errors leave as :class:`fdq.errors.EngineError`.
    """
    def decorate(func):
        if inspect.isgeneratorfunction(func):
            raise ValueError("Generators can not be wrapped with fdq.transactional")
        unwrapped = inspect.unwrap(func)
        index = inspect.getfullargspec(unwrapped).args.index(parameter)

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            target = args[index]
            if is_transaction(target):
                return _no_generator(func(*args, **kwargs))
            largs = list(args)

            def body(tr, _attempt):
                largs[index] = tr
                return func(*largs, **kwargs)
            return transact(target, body)
        return wrapper

    return decorate(func) if func is not None else decorate


def run_within(db, timeout_ms: int, func, *args, **kwargs):
    """Run ``func(tr, *args, **kwargs)`` in a new transaction and commit, retrying as
    ``transactional`` does, but for at most ``timeout_ms`` in all (the transaction's
    timeout option, kept across retries): past it, ``EngineError`` 1031
    (transaction_timed_out). For work that may be given up, such as a leaving
    consumer's goodbye, whose effect others reach anyway by timeouts."""
    return transact(db, lambda tr, _attempt: func(tr, *args, **kwargs), timeout_ms=timeout_ms)
