"""The host scheduler driven by hand-made "device" outputs: admission, chunking, stops, cancel,
pages: prefix hits, growth, preemption and resumption."""

import numpy as np
import pytest
from tiny import train_tokenizer

from jinfer import SamplingParams, load_tokenizer
from jinfer.paging import KVPages
from jinfer.scheduler import QueueFullError, Request, deliver
from jinfer.scheduler import Scheduler as _Scheduler
from jinfer.tokenizer import TextStream

EOS = 2
PAGE = 4


class Scheduler(_Scheduler):
    """The scheduler, its returned events delivered at once, as the engine does after each call;
    a pool of `pages` pages of 4 positions, sequences of up to 128, prompt pieces of 16 tokens
    (prefix caching off unless asked: the requests here share their prompts)."""

    def __init__(self, tokenizer, max_slots, max_queue, token_budget, pages=64, caching=False, **kw):
        kv = KVPages(pages, PAGE, max_slots, 128 // PAGE, caching)
        super().__init__(tokenizer, max_slots, max_queue, token_budget, kv, piece_len=16, **kw)

    def plan(self):
        plan = super().plan()
        deliver(plan.events)
        return plan

    def commit(self, *args, **kwargs):
        committed = super().commit(*args, **kwargs)
        deliver(committed.events)
        return committed


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tok"))
    train_tokenizer(directory)
    return load_tokenizer(directory)


def _request(tokenizer, rid, prompt_len=5, events=None, **sampling):
    sp = SamplingParams(**{"max_tokens": 8, **sampling})
    prompt = list(range(40, 40 + prompt_len))
    sink = (events if events is not None else []).append
    return Request(
        rid,
        prompt,
        sp,
        sp.max_tokens,
        frozenset({EOS}),
        0,
        sink,
        TextStream(tokenizer, prompt, tuple(sp.stop or ())),
    )


def _tokens(*rows):
    """[steps, rows] token array from per-row sequences."""
    return np.array(rows, dtype=np.int32).T


def test_queue_bound_admission_and_chunked_prefill(tokenizer):
    s = Scheduler(tokenizer, max_slots=2, max_queue=3, token_budget=64)
    long, a, b = _request(tokenizer, "long", 70), _request(tokenizer, "a"), _request(tokenizer, "b")
    for r in (long, a, b):
        s.submit(r)
    with pytest.raises(QueueFullError):
        s.submit(_request(tokenizer, "c"))
    plan = s.plan()
    # Budget 64, four pieces of 16: the long prompt's first 64 tokens take them all; "a" waits.
    assert [(w.request.request_id, w.start, len(w.tokens), w.last) for w in plan.prefills] == [
        ("long", 0, 64, False)
    ]
    assert plan.decode_owners == [None, None] and list(s.waiting) == [a, b]
    plan = s.plan()  # the long prompt's rest first, then as many admissions as a slot allows
    assert [(w.request.request_id, w.start, len(w.tokens), w.last) for w in plan.prefills] == [
        ("long", 64, 6, True),
        ("a", 0, 5, True),
    ]
    # A request whose last chunk runs now is decoded by this iteration's decode dispatch too.
    assert plan.decode_owners == [long, a] and list(s.waiting) == [b]


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_decode_tokens_come_first_and_prompts_fill_the_rest_of_the_budget(tokenizer, decode_steps):
    s = Scheduler(tokenizer, 4, max_queue=8, token_budget=32 + decode_steps, decode_steps=decode_steps)
    first = _request(tokenizer, "first", 5, max_tokens=100)
    s.submit(first)
    assert [w.request for w in s.plan().prefills] == [first]
    waiting = [_request(tokenizer, rid, n) for rid, n in (("second", 20), ("third", 3), ("fourth", 40))]
    for request in waiting:
        s.submit(request)
    # One row decodes decode_steps tokens; the 32 left make two pieces of 16: "second" (20 tokens:
    # two pieces) is admitted and prefilled whole, "third" waits.
    plan = s.plan()
    assert [(w.request.request_id, w.start, len(w.tokens), w.last) for w in plan.prefills] == [
        ("second", 0, 20, True)
    ]
    assert plan.decode_owners == [first, waiting[0], None, None]
    plan = s.plan()  # two rows decode now: one piece is left ("fourth" waits)
    assert [(w.request.request_id, w.start, len(w.tokens), w.last) for w in plan.prefills] == [
        ("third", 0, 3, True)
    ]


@pytest.mark.parametrize("steps", [1, 4])
def test_a_prompt_ending_beside_the_decode_rows_in_one_forward_decodes_from_the_next_plan(tokenizer, steps):
    """Decode rows riding with prompt pieces take one step, whatever a decode dispatch of their own
    scans (`steps`); the budget leaves the prompts what one step a row takes."""
    s = Scheduler(tokenizer, 4, max_queue=8, token_budget=49, decode_with_prompts=True, decode_steps=steps)
    first = _request(tokenizer, "first", 5, max_tokens=100)
    s.submit(first)
    assert s.plan().decode_owners == [None] * 4  # nothing to ride with: no decode row yet
    second = _request(tokenizer, "second", 20, max_tokens=100)
    s.submit(second)
    third = _request(tokenizer, "third", 5, max_tokens=100)
    s.submit(third)
    # The first's decode row (one token) leaves three pieces of the 49: the second's whole prompt
    # (two) and the third's (one), in one forward with that row.
    plan = s.plan()
    assert [w.request for w in plan.prefills] == [second, third] and plan.prefills[1].last
    assert plan.decode_owners == [first, None, None, None] and plan.decode_steps == 1
    assert (first.in_flight, second.in_flight) == (2, 1)  # first: prefill's token + this decode's
    plan = s.plan()
    assert plan.decode_owners == [first, second, third, None] and plan.decode_steps == steps
    assert (first.in_flight, second.in_flight) == (2 + steps, 1 + steps)


def test_the_pieces_left_fill_the_bucket_the_dispatch_is_padded_to(tokenizer):
    s = Scheduler(tokenizer, 4, max_queue=8, token_budget=64, piece_buckets=(1, 2, 4))
    first = _request(tokenizer, "first", 5, max_tokens=100)
    s.submit(first)
    s.plan()
    long = _request(tokenizer, "long", 100)
    s.submit(long)
    # One decode token leaves 63: three whole pieces, padded to four in the dispatch: four it is.
    assert [(w.request, len(w.tokens)) for w in s.plan().prefills] == [(long, 64)]


def test_an_iteration_admits_every_request_a_slot_the_pool_and_the_budget_allow(tokenizer):
    s = Scheduler(tokenizer, max_slots=6, max_queue=16, token_budget=512)
    requests = [_request(tokenizer, f"r{i}", 10 + i) for i in range(8)]
    for request in requests:
        s.submit(request)
    plan = s.plan()
    assert [w.request for w in plan.prefills] == requests[:6] and all(w.last for w in plan.prefills)
    assert plan.decode_owners == requests[:6] and list(s.waiting) == requests[6:]


def test_commit_stops_on_eos_length_and_ignores_results_after_finish(tokenizer):
    s = Scheduler(tokenizer, max_slots=3, max_queue=8, token_budget=512)
    ev_eos, ev_len, ev_min = [], [], []
    r_eos = _request(tokenizer, "eos", events=ev_eos)
    r_len = _request(tokenizer, "len", events=ev_len, max_tokens=3)
    r_min = _request(tokenizer, "min", events=ev_min, min_tokens=2)
    for r in (r_eos, r_len, r_min):
        s.submit(r)
    owners = s.plan().decode_owners
    s.commit(owners, _tokens([70, EOS, 71, 72], [70, 71, 72, 73], [EOS, 70, EOS, 71]), np.zeros((4, 3), bool))
    assert r_eos.output_ids == [70] and ev_eos[-1].finish_reason == "stop"
    assert r_len.output_ids == [70, 71, 72] and ev_len[-1].finish_reason == "length"
    # min_tokens=2: the first EOS is kept as text would be (host never stops early), the second stops.
    assert r_min.output_ids == [EOS, 70] and ev_min[-1].finish_reason == "stop"
    assert s.slots == [None, None, None]
    # The device ran ahead: results for the same (finished) owners are ignored.
    s.commit(owners, _tokens([80], [80], [80]), np.zeros((1, 3), bool))
    assert r_eos.output_ids == [70] and len(ev_eos) == 2


def test_no_decode_dispatch_for_tokens_that_work_in_flight_already_covers(tokenizer):
    s = Scheduler(tokenizer, max_slots=1, max_queue=8, token_budget=512, decode_steps=4)
    events = []
    request = _request(tokenizer, "r", events=events, max_tokens=6)
    s.submit(request)
    first = s.plan()  # the last (only) chunk samples token 1; the decode dispatch after it 2-5
    assert first.prefills[0].last and first.decode_owners == [request]
    second = s.plan()  # the engine plans before reading the first: 5 in flight, 6 wanted
    assert second.decode_owners == [request]
    s.commit([request], _tokens([70]), np.zeros((1, 1), bool))
    s.commit(first.decode_owners, _tokens([71, 72, 73, 74]), np.zeros((4, 1), bool))
    third = s.plan()  # 5 committed + 4 in flight >= 6: a third dispatch would only be discarded
    assert not third.decodes and third.prefills == [] and s.has_work
    s.commit(second.decode_owners, _tokens([75, 76, 77, 78]), np.zeros((4, 1), bool))
    assert request.output_ids == [70, 71, 72, 73, 74, 75] and events[-1].finish_reason == "length"
    assert not s.has_work


def test_events_are_returned_not_delivered(tokenizer):
    """The scheduler hands events back (the engine delivers them outside its lock)."""
    s = _Scheduler(tokenizer, 1, 8, 512, KVPages(16, PAGE, 1, 32, prefix_caching=False))
    events = []
    request = _request(tokenizer, "r", events=events)
    s.submit(request)
    committed = s.commit(s.plan().decode_owners, _tokens([70, 71]), np.zeros((2, 1), bool))
    assert events == [] and [e.output.token_ids for e in committed.events] == [[70], [71]]
    s.cancel("r")
    plan = s.plan()
    assert events == [] and plan.events[-1].output.finish_reason == "abort"
    deliver(plan.events)
    assert events[-1].finished


def test_bad_logits_end_one_request_and_mark_its_pages(tokenizer):
    s = Scheduler(tokenizer, max_slots=2, max_queue=8, token_budget=512, caching=True)
    good_events, bad_events = [], []
    good, bad = _request(tokenizer, "good", events=good_events), _request(tokenizer, "bad", events=bad_events)
    s.submit(good)
    s.submit(bad)
    owners = s.plan().decode_owners
    shared, own = bad.kv.pages  # its prompt's full page was found in the cache: good's
    assert good.kv.pages[0] == shared and bad.cached_tokens == PAGE
    committed = s.commit(owners, _tokens([70, 71], [70, 71]), np.array([[False, True], [False, False]]))
    assert bad_events[-1].finish_reason == "error" and "NaN" in bad_events[-1].error and bad.output_ids == []
    assert good.output_ids == [70, 71] and not good.finished
    # Its own page is to be zeroed; none of its pages (the shared one neither) stays findable.
    assert committed.poisoned_pages == [own] and s.slots == [good, None]
    assert s.kv.pool.cached == 0 and s.kv.pool.refs(shared) == 1


def test_cancel_waiting_and_running(tokenizer):
    s = Scheduler(tokenizer, max_slots=1, max_queue=8, token_budget=512)
    ev_run, ev_wait = [], []
    running, waiting = _request(tokenizer, "run", events=ev_run), _request(tokenizer, "wait", events=ev_wait)
    s.submit(running)
    s.submit(waiting)
    s.plan()
    assert s.cancel("wait") and s.cancel("run") and not s.cancel("unknown")
    plan = s.plan()
    assert ev_run[-1].finish_reason == "abort" and ev_wait[-1].finish_reason == "abort"
    assert plan.prefills == [] and not plan.decodes and not s.has_work


def test_text_stream_holds_back_possible_stop_strings(tokenizer):
    ids = tokenizer.encode("the quick brown fox", add_special_tokens=False)
    stream = TextStream(tokenizer, [], ("brown",))
    emitted, stopped = "", False
    for token in ids:
        text, stopped = stream.add(token)
        emitted += text
        assert "b" not in emitted  # "b", "br", ... might start "brown": never sent early
        if stopped:
            break
    assert stopped and emitted == "the quick "
    assert stream.finish() == ""
    # A false start is released once it cannot be the stop string any more.
    stream = TextStream(tokenizer, [], ("brown",))
    out = "".join(stream.add(t)[0] for t in tokenizer.encode("bro and brew", add_special_tokens=False))
    assert out + stream.finish() == "bro and brew"


class FakeDevice:
    """Runs a scheduler's plans as the engine does (results read one iteration late), with tokens
    that depend only on the request and the output index, as exact decoding's do."""

    def __init__(self, scheduler):
        self.s, self.produced, self.pending = scheduler, {}, []
        self.plans = []  # every plan run, in order

    @staticmethod
    def token(request, index):
        return 50 + (sum(map(ord, request.request_id)) * 7 + index) % 200

    def step(self):
        plan = self.s.plan()
        self.plans.append(plan)
        results = []
        for work in plan.prefills:
            if work.last:
                results.append(([work.request], self._first(work.request)))
        if plan.decodes:
            steps = plan.decode_steps
            rows = []
            for r in plan.decode_owners:
                rows.append(
                    [0] * steps if r is None else [self.token(r, self.produced[r] + j) for j in range(steps)]
                )
                if r is not None:
                    self.produced[r] += steps
            results.append((plan.decode_owners, np.array(rows, np.int32).T))
        previous, self.pending = self.pending, results
        for owners, tokens in previous:
            self.s.commit(owners, tokens, np.zeros(tokens.shape, bool))

    def _first(self, request):
        """The token a request's last prefill chunk samples: output number generated_before."""
        self.produced[request] = request.generated_before + 1
        return np.array([[self.token(request, request.generated_before)]], np.int32)

    def run(self, limit=500):
        for _ in range(limit):
            if not self.s.has_work and not self.pending:
                return
            self.step()
        raise AssertionError("the scheduler did not finish its work")


def test_a_prompt_seen_before_is_found_in_the_cache_and_only_its_rest_prefilled(tokenizer):
    s = Scheduler(tokenizer, max_slots=2, max_queue=8, token_budget=512, caching=True)
    first, again = _request(tokenizer, "first", 10), _request(tokenizer, "again", 10)
    s.submit(first)
    FakeDevice(s).run()
    s.submit(again)
    plan = s.plan()
    # 10 prompt tokens: two full pages cached (and the first's output after them).
    assert [(w.start, len(w.tokens)) for w in plan.prefills] == [(8, 2)] and again.cached_tokens == 8
    assert again.kv.pages[:2] == first.kv.pages[:2] or s.kv.pool.refs(again.kv.pages[0]) == 1
    assert (s.kv.queries, s.kv.hits) == (20, 8)


def test_a_whole_cached_prompt_still_computes_its_last_page(tokenizer):
    """The last prompt token must be computed for its logits, and a shared page is never written:
    a prompt of exactly two cached pages takes one from the cache and computes the other."""
    s = Scheduler(tokenizer, max_slots=1, max_queue=8, token_budget=512, caching=True)
    s.submit(_request(tokenizer, "first", 8))
    FakeDevice(s).run()
    again = _request(tokenizer, "again", 8)
    s.submit(again)
    assert [(w.start, len(w.tokens)) for w in s.plan().prefills] == [(4, 4)]


def test_salts_keep_tenants_apart(tokenizer):
    s = Scheduler(tokenizer, max_slots=1, max_queue=8, token_budget=512, caching=True)
    mine = _request(tokenizer, "mine", 10)
    mine.kv.salt = "tenant-a"
    s.submit(mine)
    FakeDevice(s).run()
    theirs, mine_again = _request(tokenizer, "theirs", 10), _request(tokenizer, "mine-again", 10)
    theirs.kv.salt, mine_again.kv.salt = "tenant-b", "tenant-a"
    for request in (theirs, mine_again):
        s.submit(request)
        FakeDevice(s).run()
    assert (theirs.cached_tokens, mine_again.cached_tokens) == (0, 8)


@pytest.mark.parametrize("decode_steps", [1, 3])
def test_out_of_pages_the_latest_admitted_is_preempted_and_resumes_exactly(tokenizer, decode_steps):
    """Three requests that together need more pages than the pool has: the latest admitted are
    preempted (their tokens in flight still committed), readmitted with their prompt and output so
    far, and every output is what it would have been alone; nothing is left held."""
    s = Scheduler(
        tokenizer,
        max_slots=3,
        max_queue=8,
        token_budget=512,
        pages=13,
        caching=True,
        decode_steps=decode_steps,
    )
    requests = [_request(tokenizer, name, 6 + i, max_tokens=20) for i, name in enumerate(("a", "b", "c"))]
    for i, request in enumerate(requests):
        request.prompt_ids = [100 + 20 * i + t for t in range(6 + i)]  # no prompt shared
        s.submit(request)
    device = FakeDevice(s)
    device.run()
    for request in requests:
        assert request.output_ids == [FakeDevice.token(request, i) for i in range(20)]
    assert s.preemptions > 0 and any(r.preemptions for r in requests[1:]) and not requests[0].preemptions
    assert s.kv.pool.used == 0 and s.slots == [None] * 3 and not s.waiting
    assert s.kv.hits > 0  # the preempted found what they had computed in the cache


def _prioritized(tokenizer, name, priority, prompt_start, **sampling):
    request = _request(tokenizer, name, 6, **{"max_tokens": 20, **sampling})
    request.prompt_ids = [prompt_start + t for t in range(6)]
    request.priority = priority
    return request


def test_the_queue_is_in_priority_order_first_come_first_served_within_one(tokenizer):
    s = Scheduler(tokenizer, max_slots=1, max_queue=8, token_budget=512)
    made = [
        _prioritized(tokenizer, name, p, 100)
        for name, p in (("a", 1), ("b", 0), ("c", 1), ("d", -2), ("e", 0))
    ]
    for request in made:
        s.submit(request)
    assert [r.request_id for r in s.waiting] == ["d", "b", "e", "a", "c"]


def test_a_request_of_higher_priority_takes_the_slot_and_the_preempted_resumes_exactly(tokenizer):
    s = Scheduler(tokenizer, max_slots=1, max_queue=8, token_budget=512, caching=True)
    background = _prioritized(tokenizer, "background", 5, 100)
    s.submit(background)
    device = FakeDevice(s)
    for _ in range(3):
        device.step()
    assert background.running and len(background.output_ids) > 0
    urgent, later = _prioritized(tokenizer, "urgent", 0, 200), _prioritized(tokenizer, "later", 5, 300)
    s.submit(later)  # the same priority as the one running: it waits its turn
    device.step()
    assert s.slots == [background] and not later.slot
    s.submit(urgent)
    device.step()
    assert s.slots == [urgent] and background.preemptions == 1
    assert [r.request_id for r in s.waiting] == ["background", "later"]  # first in line again
    device.run()
    for request in (background, urgent, later):
        assert request.output_ids == [FakeDevice.token(request, i) for i in range(20)]
    assert urgent.finished and not urgent.preemptions and s.kv.pool.used == 0


def test_out_of_pages_the_lowest_priority_is_preempted_before_the_latest_admitted(tokenizer):
    # 7 pages each to finish: room for two of the three.
    s = Scheduler(tokenizer, max_slots=3, max_queue=8, token_budget=512, pages=17, caching=True)
    first = _prioritized(tokenizer, "first", 9, 100)  # admitted first, but of the lowest priority
    others = [_prioritized(tokenizer, name, 0, 120 + 20 * i) for i, name in enumerate(("b", "c"))]
    s.submit(first)
    device = FakeDevice(s)
    device.step()
    assert first.slot is not None
    for request in others:
        s.submit(request)
    device.run()
    assert first.preemptions > 0 and not any(r.preemptions for r in others)
    for request in (first, *others):
        assert request.output_ids == [FakeDevice.token(request, i) for i in range(20)]


def test_work_below_the_default_priority_runs_in_short_dispatches_until_a_default_request_comes(tokenizer):
    """Background work alone: one decode step and one prompt piece a dispatch, so a request of the
    default priority arriving waits for little of it; beside such a request, dispatches are whole
    again. Every request's tokens are those it makes alone."""
    s = Scheduler(tokenizer, max_slots=3, max_queue=8, token_budget=512, decode_steps=4)
    background = [_prioritized(tokenizer, f"bg{i}", 2**30, 100 + 20 * i, max_tokens=40) for i in range(2)]
    for request in background:
        request.prompt_ids = request.prompt_ids * 6  # 36 tokens: three pieces of 16
        s.submit(request)
    device = FakeDevice(s)
    for _ in range(4):
        device.step()
    chunks = lambda plan: [(w.request.request_id, len(w.tokens)) for w in plan.prefills]
    assert [chunks(p) for p in device.plans] == [[("bg0", 16)], [("bg0", 16)], [("bg0", 4)], [("bg1", 16)]]
    assert [p.decode_steps for p in device.plans[3:]] == [1]  # bg0 decodes a step at a time
    urgent = _prioritized(tokenizer, "urgent", 0, 300, max_tokens=40)
    urgent.prompt_ids = urgent.prompt_ids * 6
    s.submit(urgent)
    device.step()  # its whole prompt alone (bg1's rest waits), and whole decode dispatches beside it
    assert chunks(device.plans[-1]) == [("urgent", 36)] and device.plans[-1].decode_steps == 4
    device.step()
    assert chunks(device.plans[-1]) == [("bg1", 16)] and device.plans[-1].decode_steps == 4
    while not urgent.finished:
        device.step()
    device.step()
    assert device.plans[-1].decode_steps == 1  # background alone again
    device.run()
    for request in (*background, urgent):
        assert request.output_ids == [FakeDevice.token(request, i) for i in range(40)]
