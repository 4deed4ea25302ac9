"""The client knows every problem type the server can send: each of the server's
ApiError classes (walked, not listed) is a problem type of the one list,
attnserve_client.problems, with the same status and title, and its problem
document parses to the client class of that slug, or to APIStatusError for the
few types a client has no class of its own for."""

from __future__ import annotations

import pytest

import attnserve_client as ac
from attnserve import errors as server_errors
from attnserve_client import problems

# the problem types that reach a client as APIStatusError (docs: attnserve_client.problems)
WITHOUT_CLIENT_CLASS = {"not-found", "method-not-allowed", "internal-error", "gpu-error"}


def _server_error_classes() -> list[type[server_errors.ApiError]]:
    seen: list[type[server_errors.ApiError]] = []
    todo = [server_errors.ApiError]
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo.extend(cls.__subclasses__())
    return seen


SERVER_CLASSES = _server_error_classes()
CLIENT_CLASSES = [cls for cls in ac.APIError.__subclasses__() if cls.slug is not None]


def test_the_walk_finds_every_server_error_class():
    named = {getattr(server_errors, name) for name in server_errors.__all__}
    assert named <= set(SERVER_CLASSES), named - set(SERVER_CLASSES)
    assert len(SERVER_CLASSES) >= 21


@pytest.mark.parametrize("cls", SERVER_CLASSES, ids=lambda c: c.__name__)
def test_the_client_knows_every_slug_the_server_can_send(cls):
    assert cls.slug in problems.PROBLEM_TYPES, f"{cls.__name__}: {cls.slug!r} is not in attnserve_client.problems"
    assert problems.PROBLEM_TYPES[cls.slug] == (cls.status, cls.slug, cls.title)
    doc = cls("some detail", length=3).problem("/v1/sessions/s")
    err = ac.parse_problem(cls.status, doc, {})
    assert err.status == cls.status and err.problem == doc and err.type == f"/problems/{cls.slug}"
    if cls.slug in WITHOUT_CLIENT_CLASS:
        assert type(err) is ac.APIStatusError
    else:
        assert type(err) is not ac.APIStatusError and type(err).slug == cls.slug


def test_every_problem_type_is_sent_by_the_server_and_every_client_class_is_one():
    assert {cls.slug for cls in SERVER_CLASSES} == set(problems.PROBLEM_TYPES)
    assert {cls.slug for cls in CLIENT_CLASSES} == set(problems.PROBLEM_TYPES) - WITHOUT_CLIENT_CLASS
    assert len(CLIENT_CLASSES) == len(problems.PROBLEM_TYPES) - len(WITHOUT_CLIENT_CLASS)


def test_the_one_list_is_consistent():
    for slug, p in problems.PROBLEM_TYPES.items():
        assert p.slug == slug and 400 <= p.status < 600 and p.title
    constants = [v for k, v in vars(problems).items() if k.isupper() and isinstance(v, problems.ProblemType)]
    assert sorted(constants) == sorted(problems.PROBLEM_TYPES.values())
    assert set(problems.__all__) == {"ProblemType", "PROBLEM_TYPES", "ProblemHelp", "PROBLEM_HELP"} | {
        k for k, v in vars(problems).items() if isinstance(v, problems.ProblemType)
    }
