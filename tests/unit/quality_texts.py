"""Texts for the quality-signal tests and bench/quality_bench.py: Qwen3-style thinking and answers that
are NOT loops (long math reasoning that re-checks itself, code written out twice, case enumerations,
tables, Chinese reasoning) and texts that ARE (the ways a thinking model degenerates at max_tokens).

Written to look like what Qwen3 emits in thinking mode (its "Okay, let's see" / "Wait," / "Let me
double-check" style, restated equations, \\boxed answers); they are not model output.
"""

from __future__ import annotations

MATH_THINKING = r"""Okay, let's see. I need to solve the quadratic equation 2x^2 + (-5)x + (-39) = 0 over the reals and say whether the roots are rational. Hmm, first, let me rewrite it so it's cleaner: 2x^2 - 5x - 39 = 0.

So the coefficients are a = 2, b = -5, c = -39. The quadratic formula is x = [-b ± sqrt(b^2 - 4ac)] / (2a). Let me compute the discriminant first. D = b^2 - 4ac = (-5)^2 - 4 * 2 * (-39). (-5)^2 is 25. Then 4 * 2 is 8, and 8 * (-39) is -312. So D = 25 - (-312) = 25 + 312 = 337.

Wait, let me double-check that. 4ac = 4 * 2 * (-39) = 8 * (-39) = -312. Then b^2 - 4ac = 25 - (-312) = 337. Yes, D = 337.

Now, is 337 a perfect square? Let me think. 18^2 = 324 and 19^2 = 361. So 337 is between 324 and 361, which means sqrt(337) is between 18 and 19. Therefore 337 is not a perfect square. Actually, is 337 prime? Let me check: it's not divisible by 2, 3 (3 + 3 + 7 = 13, not divisible by 3), 5, 7 (7 * 48 = 336, so 337 = 7 * 48 + 1), 11 (11 * 30 = 330, 337 - 330 = 7), 13 (13 * 25 = 325, 337 - 325 = 12), 17 (17 * 19 = 323, 337 - 323 = 14). Since 19^2 = 361 > 337, I only need to check primes up to 18. So 337 is prime. That means sqrt(337) is irrational.

So the roots are x = [5 ± sqrt(337)] / 4. Let me write that out: x1 = (5 + sqrt(337)) / 4 and x2 = (5 - sqrt(337)) / 4.

Let me approximate them to make sure they make sense. sqrt(337) is approximately 18.358, since 18.358^2 = 337.02 roughly. Let me check: 18.35^2 = 336.72, and 18.36^2 = 337.09. So sqrt(337) ≈ 18.357. Then x1 ≈ (5 + 18.357) / 4 = 23.357 / 4 ≈ 5.839. And x2 ≈ (5 - 18.357) / 4 = -13.357 / 4 ≈ -3.339.

Let me verify by plugging x1 back into the equation. 2x^2 - 5x - 39 with x ≈ 5.839: x^2 ≈ 34.094, so 2x^2 ≈ 68.188. Then 5x ≈ 29.195. So 68.188 - 29.195 - 39 = -0.007. That's close to zero, the small error comes from rounding. Good.

Now x2 ≈ -3.339: x^2 ≈ 11.149, 2x^2 ≈ 22.298, -5x ≈ 16.695, so 22.298 + 16.695 - 39 = -0.007. Also close to zero. Good.

Wait, let me also check the sum and product of the roots with Vieta's formulas. The sum should be -b/a = 5/2 = 2.5. And x1 + x2 ≈ 5.839 + (-3.339) = 2.5. Correct. The product should be c/a = -39/2 = -19.5. And x1 * x2 ≈ 5.839 * (-3.339) ≈ -19.496. Close to -19.5. Good.

Alternatively, I could check exactly: x1 * x2 = [(5 + sqrt(337))(5 - sqrt(337))] / 16 = (25 - 337) / 16 = -312 / 16 = -19.5. Yes, exactly -39/2. Great, that matches.

So the question also asks whether the roots are rational. By the rational root theorem, any rational root p/q must have p dividing -39 and q dividing 2. So the candidates are ±1, ±3, ±13, ±39, ±1/2, ±3/2, ±13/2, ±39/2. Let me test a few just to be thorough. x = 3: 2*9 - 15 - 39 = 18 - 15 - 39 = -36, not zero. x = -3: 18 + 15 - 39 = -6, not zero. x = 13/2: 2 * (169/4) - 65/2 - 39 = 84.5 - 32.5 - 39 = 13, not zero. x = -3/2: 2 * (9/4) + 15/2 - 39 = 4.5 + 7.5 - 39 = -27, not zero. None of them work, which is consistent with the discriminant not being a perfect square.

Hmm, but wait. The discriminant test is the cleanest argument: for a quadratic with integer coefficients, the roots are rational if and only if the discriminant is a perfect square. Since D = 337 is not a perfect square, the roots are irrational.

Let me make sure I didn't misread the problem. It says 2x^2 + (-5)x + (-39) = 0. So a = 2, b = -5, c = -39. Yes. And "over the reals" means we want real roots, and since D = 337 > 0, there are two distinct real roots. 

So, to summarize: the equation 2x^2 - 5x - 39 = 0 has discriminant 337, which is positive and not a perfect square, so it has two distinct real irrational roots, x = (5 ± sqrt(337)) / 4, approximately 5.839 and -3.339.

Let me just double-check the approximation of sqrt(337) once more. 18.357^2 = 18.357 * 18.357. 18^2 = 324. 2 * 18 * 0.357 = 12.852. 0.357^2 ≈ 0.127. Total ≈ 324 + 12.852 + 0.127 = 336.979. Slightly less than 337. 18.358^2 ≈ 336.979 + 2 * 18.357 * 0.001 ≈ 336.979 + 0.0367 = 337.016. So sqrt(337) ≈ 18.3576. Then x1 ≈ 23.3576 / 4 ≈ 5.8394 and x2 ≈ -13.3576 / 4 ≈ -3.3394. Okay, consistent with before.

I think that's it. The answer: two real roots, x = (5 + sqrt(337))/4 and x = (5 - sqrt(337))/4, and they are irrational because 337 is not a perfect square."""

PROBABILITY_THINKING = r"""Okay, so I need to find the probability that when rolling two fair six-sided dice, the sum is at least 9. Let me think about how to approach this.

First, the total number of outcomes when rolling two dice is 6 * 6 = 36. Each outcome is equally likely. Now I need to count the outcomes where the sum is 9, 10, 11, or 12.

Sum = 9: the pairs are (3,6), (4,5), (5,4), (6,3). That's 4 outcomes.
Sum = 10: (4,6), (5,5), (6,4). That's 3 outcomes.
Sum = 11: (5,6), (6,5). That's 2 outcomes.
Sum = 12: (6,6). That's 1 outcome.

So the total is 4 + 3 + 2 + 1 = 10 outcomes. Therefore the probability is 10/36 = 5/18.

Wait, let me double-check the count for sum = 9. The first die can be 3, 4, 5, or 6 — if the first die is 1 or 2, the second die would need to be 8 or 7, which is impossible. So yes, 4 outcomes. For sum = 10, the first die can be 4, 5, or 6: 3 outcomes. For sum = 11, the first die can be 5 or 6: 2 outcomes. For sum = 12, only (6,6): 1 outcome. Total 10. So the probability is 10/36, which simplifies to 5/18.

Alternatively, I can compute the complement: the probability that the sum is at most 8. The number of outcomes with sum s for s from 2 to 7 is s - 1, and for s from 8 to 12 it is 13 - s. So sums 2 through 8: 1 + 2 + 3 + 4 + 5 + 6 + 5 = 26. Then 36 - 26 = 10. Same answer, 10/36 = 5/18.

Hmm, 5/18 is approximately 0.2778. Let me make sure that makes sense intuitively. The most likely sum is 7, and sums of 9 or more are on the upper tail, so a bit more than a quarter seems reasonable.

So the probability is 5/18."""

CODE_THINKING = '''Okay, the user wants a Python function that returns the length of the longest substring without repeating characters. The classic approach is a sliding window with a dictionary of last seen positions.

Let me write a first version:

```python
def length_of_longest_substring(s: str) -> int:
    last_seen = {}
    start = 0
    best = 0
    for i, ch in enumerate(s):
        if ch in last_seen:
            start = last_seen[ch] + 1
        last_seen[ch] = i
        best = max(best, i - start + 1)
    return best
```

Wait, there's a bug. If the character was last seen before the current window start, I shouldn't move start backwards. For example, with "abba": at i=2 (b), start becomes 2. At i=3 (a), last_seen['a'] = 0, so start would become 1, which moves the window backwards. That's wrong. I need start = max(start, last_seen[ch] + 1).

Let me rewrite it with the fix:

```python
def length_of_longest_substring(s: str) -> int:
    last_seen = {}
    start = 0
    best = 0
    for i, ch in enumerate(s):
        if ch in last_seen:
            start = max(start, last_seen[ch] + 1)
        last_seen[ch] = i
        best = max(best, i - start + 1)
    return best
```

Let me trace "abba" again. i=0 'a': not seen, last_seen={'a':0}, best = 1. i=1 'b': not seen, last_seen={'a':0,'b':1}, best = 2. i=2 'b': seen at 1, start = max(0, 2) = 2, last_seen['b'] = 2, best = max(2, 1) = 2. i=3 'a': seen at 0, start = max(2, 1) = 2, last_seen['a'] = 3, best = max(2, 2) = 2. So the answer is 2, which is correct ("ab" or "ba").

Let me also test "abcabcbb": the answer should be 3. And "bbbbb" should be 1, "pwwkew" should be 3, and the empty string should be 0. For the empty string the loop never runs and best stays 0. Good.

Time complexity is O(n) and space is O(min(n, alphabet size)). I think this is right.'''

CODE_ANSWER = '''Here is an O(n) sliding-window solution:

```python
def length_of_longest_substring(s: str) -> int:
    last_seen = {}
    start = 0
    best = 0
    for i, ch in enumerate(s):
        if ch in last_seen:
            start = max(start, last_seen[ch] + 1)
        last_seen[ch] = i
        best = max(best, i - start + 1)
    return best
```

**How it works**

- `start` is the first index of the current window, which never holds a repeated character.
- When `ch` was seen inside the window, the window moves past its last position (`max` keeps it from moving backwards, as in `"abba"`).
- `best` is the longest window seen.

Examples: `"abcabcbb"` → 3, `"bbbbb"` → 1, `"pwwkew"` → 3, `""` → 0.'''

ENUMERATION_THINKING = "Okay, let me find all positive integers n up to 20 for which n^2 + 1 is prime. I'll just check each one.\n\n" + "\n".join(
    f"For n = {n}: n^2 + 1 = {n * n} + 1 = {n * n + 1}. Is {n * n + 1} prime? "
    + ("Yes, it is prime, so n = %d works." % n if n in (1, 2, 4, 6, 10, 14, 16, 20) else "No, it is not prime, so n = %d does not work." % n)
    for n in range(1, 21)
) + "\n\nSo the values are n = 1, 2, 4, 6, 10, 14, 16, 20."

TABLE_ANSWER = "| x | f(x) | f'(x) |\n|---|---|---|\n" + "\n".join(
    f"| {x} | {x * x - 3 * x + 2} | {2 * x - 3} |" for x in range(-10, 11)
) + "\n\nThe function has its minimum at x = 1.5, where f'(x) = 0."

MATRIX_ANSWER = r"""The 6 × 6 identity matrix is
$$
I_6 = \begin{pmatrix}
1 & 0 & 0 & 0 & 0 & 0 \\
0 & 1 & 0 & 0 & 0 & 0 \\
0 & 0 & 1 & 0 & 0 & 0 \\
0 & 0 & 0 & 1 & 0 & 0 \\
0 & 0 & 0 & 0 & 1 & 0 \\
0 & 0 & 0 & 0 & 0 & 1
\end{pmatrix}
$$
and its determinant is 1."""

CHINESE_THINKING = """好的，我需要计算一个水池的注水时间。第一根水管5小时注满水池，第二根水管13小时注满，排水管19小时排空满池。三根管子同时打开，需要多长时间注满？

首先，第一根水管每小时注入水池的1/5，第二根水管每小时注入1/13，排水管每小时排出1/19。所以每小时的净注水量是 1/5 + 1/13 - 1/19。

我来算一下。通分，5、13、19的最小公倍数是 5 × 13 × 19 = 1235。1/5 = 247/1235，1/13 = 95/1235，1/19 = 65/1235。所以净注水量是 (247 + 95 - 65)/1235 = 277/1235。

等一下，我再检查一下。247 + 95 = 342，342 - 65 = 277。对的，是 277/1235。

所以注满水池需要 1235/277 小时。1235 ÷ 277 大约等于 4.458 小时。277 × 4 = 1108，1235 - 1108 = 127，127/277 ≈ 0.458。所以大约是4.46小时，也就是大约4小时27分钟。

再验证一下：0.458 × 60 ≈ 27.5 分钟。嗯，大约4小时27分钟。答案是 1235/277 小时。"""

CHINESE_ANSWER = "三根管子同时打开时，每小时净注入水池的 1/5 + 1/13 − 1/19 = 277/1235，所以注满水池需要 1235/277 ≈ 4.46 小时，约 4 小时 27 分钟。"

ENGLISH_ANSWER = r"""The equation $2x^2 - 5x - 39 = 0$ has discriminant $D = 25 + 312 = 337$. Since $D > 0$ there are two distinct real roots,

$$x = \frac{5 \pm \sqrt{337}}{4} \approx 5.839 \text{ and } -3.339.$$

Because 337 is not a perfect square (it is prime), the roots are **irrational**."""

FRENCH_ANSWER = "L'équation a deux racines réelles distinctes, car le discriminant est positif. Comme 337 n'est pas un carré parfait, les racines sont irrationnelles : x = (5 ± √337)/4, soit environ 5,839 et −3,339."

GERMAN_ANSWER = "Die Gleichung hat zwei verschiedene reelle Lösungen, weil die Diskriminante positiv ist. Da 337 keine Quadratzahl ist, sind beide Lösungen irrational."

ANSWER_SAYING_CANNOT = "The square root of a negative number cannot be a real number, so x cannot be negative here. I can't see any other constraint: the domain is x ≥ 0 and the answer is x = 4."

NOT_A_REFUSAL_MIDWAY = "Step 1: expand the product.\nStep 2: collect terms.\nNote that we cannot divide by zero, so x ≠ 2. I'm sorry to say the textbook's answer is wrong: the right value is 7/3."

REFUSALS = (
    "I'm sorry, but I can't help with that request.",
    "I’m sorry, but I can’t assist with creating malware.",
    "I cannot help with that. If you are in danger, please contact local emergency services.",
    "Sorry, but I can't provide instructions for making weapons.",
    "As an AI language model, I cannot provide medical diagnoses. Please consult a doctor.",
    "I'm unable to help with that, as it would violate the usage policies.",
    "抱歉，我无法提供这方面的帮助。",
    "我不能协助完成这个请求。",
)

LOOP_TAIL = " ".join([
    "Wait, maybe I made a mistake in the sign. Let me re-calculate the discriminant: b^2 - 4ac = 25 + 312 = 337.",
    "So sqrt(337) is about 18.36, and the roots are (5 ± 18.36)/4. Hmm, but let me check again whether I used the right value of c.",
])
"""One turn of a Qwen3-style loop: the model re-checks the same thing forever (here ~60 tokens a round)."""

LOOP_THINKING = MATH_THINKING[:2500] + "\n\n" + "\n\n".join([LOOP_TAIL] * 30)
"""Normal start, then the same re-check paragraph until max_tokens."""

LOOP_SHORT_PHRASE = PROBABILITY_THINKING[:800] + " So the answer is 5/18." * 60
LOOP_TOKEN = "Let me think. " + "the " * 400
LOOP_DIGITS = "The decimal expansion is 0." + "3" * 3000
LOOP_CHINESE = CHINESE_THINKING[:300] + "所以答案是1235/277小时。" * 80
LOOP_ANSWER = "The answer is \\boxed{5}. " + "Therefore, the final answer is \\boxed{5}. " * 40
LOOP_LONG_PERIOD = MATH_THINKING[:1000] + ("\n\n" + PROBABILITY_THINKING) * 4
"""A ~500-token block repeated 4 times: a long-period loop."""

NOT_LOOPS = {
    "math_thinking": MATH_THINKING,
    "probability_thinking": PROBABILITY_THINKING,
    "code_thinking": CODE_THINKING,
    "code_answer": CODE_ANSWER,
    "enumeration": ENUMERATION_THINKING,
    "table_answer": TABLE_ANSWER,
    "matrix_answer": MATRIX_ANSWER,
    "chinese_thinking": CHINESE_THINKING,
    "english_answer": ENGLISH_ANSWER,
    "long_mixed_thinking": "\n\n".join([MATH_THINKING, PROBABILITY_THINKING, CODE_THINKING, ENUMERATION_THINKING,
                                        CHINESE_THINKING]),
}
LOOPS = {
    "paragraph_loop": LOOP_THINKING,
    "short_phrase_loop": LOOP_SHORT_PHRASE,
    "token_loop": LOOP_TOKEN,
    "digit_loop": LOOP_DIGITS,
    "chinese_loop": LOOP_CHINESE,
    "answer_loop": LOOP_ANSWER,
    "long_period_loop": LOOP_LONG_PERIOD,
}
