"""What each diagnosis means for the people on call: quick checks and remedies.

From the operators' table in DOMAIN.md (and verl practice for the labels it does not
cover). Alerts carry these so a message at 3 a.m. says what to do next.

AlertEvents carry the English texts (:data:`KNOWLEDGE`): the engine is one for the stream
app and ``trainsentry detect``, and scripts match on stable strings. Chat messages are
localised when they are rendered: :func:`localize` swaps each known English text for its
counterpart in :data:`KNOWLEDGE_ZH` (same label, same position) and leaves any other text
as it is.

>>> localize(["lower the learning rate", "page Bob"], "zh")
['降低学习率', 'page Bob']
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["LABELS", "LANGUAGES", "Knowledge", "KNOWLEDGE", "KNOWLEDGE_ZH", "knowledge",
           "localize", "FIX_BEFORE_RESTART", "for_run", "has_critic"]

#: The languages chat messages are written in (``TRAINSENTRY_LANGUAGE``).
LANGUAGES: tuple[str, ...] = ("zh", "en")

LABELS: tuple[str, ...] = (
    "dataloader_stall", "kl_drift", "numeric_underflow", "comm_degradation", "memory_leak",
    "nan_loss", "training_hang", "straggler", "gradient_instability", "lr_drift",
    "entropy_collapse", "stalled_learning", "unknown",
)


@dataclass(frozen=True)
class Knowledge:
    title: str
    checks: tuple[str, ...]
    actions: tuple[str, ...]


KNOWLEDGE: dict[str, Knowledge] = {
    "dataloader_stall": Knowledge(
        "input pipeline stall (GPUs starved)",
        ("iostat -x 1 (await, %util) on the rollout hosts", "nvidia-smi dmon -s u"),
        ("check the dataset mount / object store", "add data-loader workers",
         "use memory-mapped or locally cached datasets"),
    ),
    "kl_drift": Knowledge(
        "KL to the reference running away",
        ("freeze the critic briefly and see whether KL settles",
         "look for bias or an exploit in the reward function"),
        ("lower the critic learning rate", "more critic steps per update",
         "review the reward prompt / reward shaping", "raise the KL coefficient"),
    ),
    "numeric_underflow": Knowledge(
        "logits underflow: empty responses, collapsing length",
        ("print logits max/min before sampling", "check fp16 in attention"),
        ("switch to bf16", "clip logits before softmax", "check for corrupted weights"),
    ),
    "comm_degradation": Knowledge(
        "communication (NCCL / network) degraded",
        ("nvidia-smi nvlink -g 0", "ibstat", "NCCL_DEBUG=INFO logs"),
        ("restart NCCL / the affected nodes", "check the RDMA configuration",
         "fall back to plain data parallel to confirm"),
    ),
    "memory_leak": Knowledge(
        "GPU memory creeping toward OOM",
        ("torch.cuda.memory_summary() before/after a step", "look for retain_graph=True"),
        ("enforce use_cache=False / gradient checkpointing", "upgrade PyTorch",
         "tracemalloc for Python-side leaks", "save a checkpoint before it OOMs"),
    ),
    "nan_loss": Knowledge(
        "loss or gradient norm is NaN/inf",
        ("find the first step with a non-finite value in the trainer log",
         "check the batch at that step for empty or extreme samples"),
        ("roll back to the last healthy checkpoint", "lower the learning rate",
         "enable gradient clipping", "use bf16 instead of fp16"),
    ),
    "training_hang": Knowledge(
        "no new training step",
        ("py-spy dump --pid <trainer pid> on each rank", "NCCL_DEBUG=INFO, check for a stuck collective",
         "is the process / host alive? (ray status, dmesg)"),
        ("kill and restart from the last checkpoint", "set NCCL timeouts (NCCL_TIMEOUT)"),
    ),
    "straggler": Knowledge(
        "one rank much slower than its peers",
        ("nvidia-smi -q -d CLOCK,PERFORMANCE on the slow host (throttling?)",
         "dmesg for XID errors", "check the host's network link"),
        ("drain or replace the slow node", "rebalance the rollout workers"),
    ),
    "gradient_instability": Knowledge(
        "gradient norm unstable",
        ("plot actor/grad_norm and pg_clipfrac for the last steps",
         "look for outlier samples or rewards"),
        ("lower the learning rate", "tighten gradient clipping", "increase the batch size"),
    ),
    "lr_drift": Knowledge(
        "learning rate off its configured schedule",
        ("compare actor/lr with the scheduler config (warmup, decay, total steps)",
         "did a resume restore the scheduler state?",
         "was the change planned? declare it in actor_rollout_ref.actor.optim.lr_milestones"),
        ("fix the scheduler configuration or the resume step", "restart from a checkpoint"),
    ),
    "entropy_collapse": Knowledge(
        "policy entropy collapsed (possible reward hacking)",
        ("read a sample of recent responses for repetition / exploits",
         "compare reward with validation score"),
        ("roll back to before the collapse", "raise the entropy coefficient or temperature",
         "lower the learning rate", "fix the reward exploit"),
    ),
    "stalled_learning": Knowledge(
        "no learning signal (dead run)",
        ("are all rewards identical? check the reward function on a few samples",
         "are responses cut at max_response_length? (response_length/clip_ratio)"),
        ("fix the reward function or data", "raise max_response_length",
         "stop the run: it is burning GPU time without learning"),
    ),
    "unknown": Knowledge(
        "anomalous signal, no known pattern",
        ("look at the signal's chart around the step", "check the trainer log"),
        ("watch the next steps; acknowledge if expected",),
    ),
}


#: The same knowledge in Chinese: per label, the title, checks and actions in the order of
#: :data:`KNOWLEDGE` (commands, metric keys and setting names stay as they are typed).
KNOWLEDGE_ZH: dict[str, Knowledge] = {
    "dataloader_stall": Knowledge(
        "输入流水线阻塞（GPU 在等数据）",
        ("在 rollout 主机上运行 iostat -x 1（看 await、%util）", "nvidia-smi dmon -s u"),
        ("检查数据集挂载 / 对象存储", "增加 data loader 的 worker 数",
         "使用内存映射或本地缓存的数据集"),
    ),
    "kl_drift": Knowledge(
        "与参考模型的 KL 持续失控",
        ("短暂冻结 critic，看 KL 是否回落", "检查奖励函数是否有偏差或可被钻空子"),
        ("降低 critic 学习率", "每次更新多做几步 critic", "复查奖励 prompt / 奖励塑形",
         "调大 KL 系数"),
    ),
    "numeric_underflow": Knowledge(
        "logits 下溢：空回复增多、回复长度塌缩",
        ("采样前打印 logits 的最大/最小值", "检查 attention 是否在用 fp16"),
        ("改用 bf16", "softmax 前裁剪 logits", "检查权重是否损坏"),
    ),
    "comm_degradation": Knowledge(
        "通信（NCCL / 网络）性能退化",
        ("nvidia-smi nvlink -g 0", "ibstat", "查看 NCCL_DEBUG=INFO 日志"),
        ("重启 NCCL / 受影响的节点", "检查 RDMA 配置", "退回纯数据并行以确认问题"),
    ),
    "memory_leak": Knowledge(
        "显存持续上涨，逼近 OOM",
        ("对比一步前后的 torch.cuda.memory_summary()", "查找 retain_graph=True"),
        ("确保 use_cache=False / 开启梯度检查点", "升级 PyTorch",
         "用 tracemalloc 排查 Python 侧泄漏", "在 OOM 之前保存一个 checkpoint"),
    ),
    "nan_loss": Knowledge(
        "损失或梯度范数为 NaN/inf",
        ("在训练日志中找到第一次出现非有限值的步", "检查该步的 batch 是否有空样本或极端样本"),
        ("回滚到最近一个健康的 checkpoint", "降低学习率", "开启梯度裁剪", "用 bf16 代替 fp16"),
    ),
    "training_hang": Knowledge(
        "没有新的训练步",
        ("在每个 rank 上运行 py-spy dump --pid <trainer pid>",
         "设置 NCCL_DEBUG=INFO，检查是否卡在某个集合通信",
         "进程 / 主机还活着吗？（ray status、dmesg）"),
        ("杀掉进程并从最近的 checkpoint 重启", "设置 NCCL 超时（NCCL_TIMEOUT）"),
    ),
    "straggler": Knowledge(
        "某个 rank 明显慢于其他 rank",
        ("在慢主机上运行 nvidia-smi -q -d CLOCK,PERFORMANCE（是否降频？）",
         "在 dmesg 中查找 XID 错误", "检查该主机的网络链路"),
        ("摘除或替换慢节点", "重新均衡 rollout worker"),
    ),
    "gradient_instability": Knowledge(
        "梯度范数不稳定",
        ("画出最近几步的 actor/grad_norm 和 pg_clipfrac", "查找离群的样本或奖励"),
        ("降低学习率", "收紧梯度裁剪", "增大 batch size"),
    ),
    "lr_drift": Knowledge(
        "学习率偏离了配置的调度",
        ("对比 actor/lr 与调度器配置（warmup、decay、总步数）",
         "续训时是否恢复了调度器状态？",
         "这次变化是计划内的吗？请在 actor_rollout_ref.actor.optim.lr_milestones 中声明"),
        ("修正调度器配置或续训的起始步", "从 checkpoint 重启"),
    ),
    "entropy_collapse": Knowledge(
        "策略熵坍缩（可能存在 reward hacking）",
        ("抽读一些最近的回复，看是否重复或在钻空子", "对比奖励与验证集得分"),
        ("回滚到坍缩之前", "调大熵系数或采样温度", "降低学习率", "修复奖励漏洞"),
    ),
    "stalled_learning": Knowledge(
        "没有学习信号（训练已停滞）",
        ("所有奖励都一样吗？在几个样本上检查奖励函数",
         "回复是否都被 max_response_length 截断？（response_length/clip_ratio）"),
        ("修复奖励函数或数据", "调大 max_response_length", "停止该运行：它在空耗 GPU 而没有学习"),
    ),
    "unknown": Knowledge(
        "信号异常，但不符合已知模式",
        ("查看该信号在这一步前后的曲线", "检查训练日志"),
        ("观察接下来几步；如属预期请确认（ack）",),
    ),
}

_BY_LANGUAGE: Mapping[str, Mapping[str, Knowledge]] = MappingProxyType(
    {"en": MappingProxyType(KNOWLEDGE), "zh": MappingProxyType(KNOWLEDGE_ZH)})


def knowledge(label: str, language: str = "en") -> Knowledge:
    """The checks and actions of ``label`` in ``language`` (``unknown``'s for other labels)."""
    if language not in _BY_LANGUAGE:
        raise ValueError(f"language must be one of {', '.join(LANGUAGES)}, got {language!r}")
    book = _BY_LANGUAGE[language]
    return book.get(label, book["unknown"])


#: The first action of a notice whose run died with the problem still firing.
FIX_BEFORE_RESTART = "fix this before restarting the run"
_GENERAL: dict[str, dict[str, str]] = {
    "zh": {FIX_BEFORE_RESTART: "重启训练前先解决这个问题"},
    "en": {},
}


def has_critic(config: Mapping[str, object]) -> bool:
    """Whether a run trains a critic, from its ``run_started`` config (verl's rule:
    ``critic.enable`` when set, else only the ``gae`` advantage estimator). Unknown: True."""
    enable = config.get("critic.enable")
    if isinstance(enable, bool):
        return enable
    estimator = config.get("algorithm.adv_estimator")
    return not isinstance(estimator, str) or estimator.lower() == "gae"


#: For a run without a critic (GRPO, RLOO, ...), what replaces a text about the critic
#: (``None``: dropped).
_NO_CRITIC: dict[str, str | None] = {
    "freeze the critic briefly and see whether KL settles": None,
    "lower the critic learning rate": "lower the learning rate",
    "more critic steps per update": None,
}


def for_run(label: str, config: Mapping[str, object]) -> Knowledge:
    """:func:`knowledge` of ``label`` for one run: a run without a critic is never told to
    tune one (a GRPO team at 3 a.m. cannot follow that)."""
    know = KNOWLEDGE.get(label, KNOWLEDGE["unknown"])
    if has_critic(config):
        return know

    def adapt(texts: tuple[str, ...]) -> tuple[str, ...]:
        out = [_NO_CRITIC.get(t, t) for t in texts]
        return tuple(dict.fromkeys(t for t in out if t is not None))

    return Knowledge(know.title, adapt(know.checks), adapt(know.actions))


def _translations(language: str) -> Mapping[str, str]:
    out: dict[str, str] = dict(_GENERAL[language])
    for label, en in KNOWLEDGE.items():
        other = _BY_LANGUAGE[language][label]
        for src, dst in ((en.checks, other.checks), (en.actions, other.actions),
                         ((en.title,), (other.title,))):
            out.update(zip(src, dst, strict=True))
    return MappingProxyType(out)


_TRANSLATIONS: Mapping[str, Mapping[str, str]] = MappingProxyType(
    {lang: _translations(lang) for lang in _BY_LANGUAGE})


def localize(texts: Iterable[str], language: str) -> list[str]:
    """``texts`` (an alert's checks or actions) in ``language``: known English texts are
    replaced by their translation, anything else (a custom action) is kept verbatim."""
    table = _TRANSLATIONS.get(language)
    if table is None:
        raise ValueError(f"language must be one of {', '.join(LANGUAGES)}, got {language!r}")
    return [table.get(t, t) for t in texts]
