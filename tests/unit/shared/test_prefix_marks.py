"""The names the gateway gives a conversation's prefixes (shared/prefix_marks.py). No I/O."""

from shared import prefix_marks
from shared.wire import GenerationRequest

SYSTEM = {"role": "system", "content": "You are a careful agent."}


def chat(*messages: dict, **fields) -> GenerationRequest:
    return GenerationRequest(job="j", model="m", kind="chat", messages=list(messages), **fields)


def names(request: GenerationRequest) -> list[str]:
    return [mark for mark, _ in prefix_marks.marks(request)]


def test_a_next_turn_shares_every_mark_of_the_turn_before():
    turn1 = chat(SYSTEM, {"role": "user", "content": "hello"})
    turn2 = chat(
        *turn1.messages, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "why?"}
    )
    assert names(turn2)[:2] == names(turn1) and len(set(names(turn2))) == 4
    chars = [c for _, c in prefix_marks.marks(turn2)]
    assert chars == sorted(chars) and chars[0] > len("You are a careful agent.")
    assert prefix_marks.marks(turn1) == prefix_marks.marks(
        chat(*turn1.messages)
    )  # the same for every gateway


def test_a_change_anywhere_before_changes_every_mark_after():
    base = chat(SYSTEM, {"role": "user", "content": "hello"})
    other_user = chat(SYSTEM, {"role": "user", "content": "hello!"})
    assert names(other_user)[0] == names(base)[0] and names(other_user)[1] != names(base)[1]
    tools = chat(*base.messages, tools=[{"type": "function", "function": {"name": "f"}}])
    other_model = base.model_copy(update={"model": "n"})
    assert not set(names(tools)) & set(names(base)) and not set(names(other_model)) & set(
        names(base)
    )


def test_no_marks_for_completions_or_images_and_at_most_32_for_a_long_conversation():
    assert (
        prefix_marks.marks(GenerationRequest(job="j", model="m", kind="completion", prompt="hi"))
        == []
    )
    assert prefix_marks.marks(chat(SYSTEM, images=[b"png"])) == []
    long = chat(SYSTEM, *({"role": "user", "content": str(i)} for i in range(99)))
    kept = names(
        long
    )  # the first 2 (a shared system prompt) and the last 30 (where a next turn matches)
    assert len(kept) == prefix_marks.MAX_MARKS and kept[:2] == names(chat(*long.messages[:2]))
    assert kept[2] == names(chat(*long.messages[: 100 - 29]))[-1]


def test_a_session_is_kept_under_a_hash_of_its_owner_and_hint():
    one = prefix_marks.session("team-a", "conversation-1")
    assert (
        one
        == prefix_marks.session("team-a", "conversation-1")
        != prefix_marks.session("team-b", "conversation-1")
    )
    assert "conversation" not in one and len(one) == 2 * prefix_marks.DIGEST_BYTES


def test_a_cache_salt_names_other_marks_and_the_key_scope_salts_by_key():
    base = chat(SYSTEM, {"role": "user", "content": "hello"})
    salted = base.model_copy(update={"cache_salt": prefix_marks.salt("fleet", "alice", "s1")})
    assert not set(names(salted)) & set(names(base))
    assert (
        prefix_marks.salt("fleet", "alice", None) == "" == prefix_marks.salt("fleet", "bob", None)
    )
    assert prefix_marks.salt("fleet", "alice", "s1") == prefix_marks.salt("fleet", "bob", "s1")
    assert prefix_marks.salt("key", "alice", None) != prefix_marks.salt("key", "bob", None)
    assert (
        prefix_marks.salt("key", None, None) == ""
    )  # no API key (auth off, the admin key): unsalted, as before
    assert prefix_marks.salt("key", "alice", "s1") not in (
        prefix_marks.salt("key", "bob", "s1"),
        prefix_marks.salt("key", "alice", "s2"),
        "",
    )
