//! User histories: synthetic ones with learnable structure, the
//! leave-one-out split, and the batches sequence models read.

use ember_dense::Tensor;
use ember_sparse::rng::Rng;
use ember_sparse::KeyedJaggedTensor;

use crate::{Batch, ModelError, SyntheticError};

/// The feature a sequence model's batch carries its histories under: item
/// ids, and as weights each item's seconds since the user's first.
pub const HISTORY_FEATURE: &str = "history";

/// The feature a batch carries each history item's action under (when
/// the histories have actions), in the [`HISTORY_FEATURE`]'s layout.
pub const ACTIONS_FEATURE: &str = "actions";

/// The feature of the items a sequence model scores each input against
/// (its next item and the negatives).
pub(crate) const TARGETS_FEATURE: &str = "targets";

pub use ember_dataloader::sequences::UserHistory;

/// Histories with structure a model can learn: items belong to topics and
/// are Zipf-popular within them; a user stays in a topic and drifts to
/// another with a fixed chance at each step; lengths are Zipf-distributed
/// between 3 and a maximum. Each item comes with an action of two bits,
/// drawn apart from the items (the histories are those of a run without
/// actions): bit 0, engaged, likelier (0.8 against 0.3) on items of the
/// user's first topic; bit 1, liked, from the user's own propensity
/// (uniform in 0.1 to 0.9) raised or lowered by the item's quality (half
/// the items, by id, are good). Reproducible from the seed.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticHistories {
    /// Users, one history each.
    pub num_users: usize,
    /// Items (ids `0..num_items`).
    pub num_items: usize,
    /// Topics the items are spread over (item `i`'s is `i % num_topics`).
    pub num_topics: usize,
    /// The longest history.
    pub max_len: usize,
    /// Exponent of the lengths' Zipf law (larger: shorter histories).
    pub length_alpha: f64,
    /// Exponent of the items' popularity within a topic.
    pub popularity_alpha: f64,
    /// The chance, at each item, that the user moves to another topic.
    pub drift: f64,
    /// The chance, at each item, that a new session starts: 3 to 30 days
    /// after the last item, back in the user's first topic 4 times in 5
    /// (else a random one); within a session items are minutes apart.
    /// 0 (the default): no sessions, items minutes to a day apart. Only
    /// a model that reads time can tell a session's first item from the
    /// rest.
    pub session_start: f64,
    /// The seed.
    pub seed: u64,
}

impl Default for SyntheticHistories {
    /// 1,000 users over 500 items in 10 topics, histories of 3 to 50,
    /// lengths and popularity Zipf 1, drift 0.1.
    fn default() -> Self {
        Self {
            num_users: 1000,
            num_items: 500,
            num_topics: 10,
            max_len: 50,
            length_alpha: 1.0,
            popularity_alpha: 1.0,
            drift: 0.1,
            session_start: 0.0,
            seed: 0,
        }
    }
}

/// Shortest synthetic history: one to train on, one to validate, one to test.
const MIN_LEN: usize = 3;

/// Zipf's law over ranks `0..n`: rank `k` with probability proportional
/// to `(k + 1)^-alpha`, drawn by the inverse CDF (history lengths and
/// popularity here; `n` is small, so the table is exact and cheap).
#[derive(Clone, Debug)]
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    /// The law over `n` ranks (at least 1) of exponent `alpha`.
    pub fn new(n: usize, alpha: f64) -> Self {
        let mut sum = 0.0;
        let mut cdf: Vec<f64> = (1..=n)
            .map(|k| {
                sum += (k as f64).powf(-alpha);
                sum
            })
            .collect();
        cdf.iter_mut().for_each(|p| *p /= sum);
        Self { cdf }
    }

    /// A rank in `0..n`.
    pub fn draw(&self, rng: &mut Rng) -> usize {
        let u = unit(rng);
        self.cdf.partition_point(|&p| p < u).min(self.cdf.len() - 1)
    }
}

fn unit(rng: &mut Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

impl SyntheticHistories {
    /// Every user's history; an error names what is out of range.
    pub fn generate(&self) -> Result<Vec<UserHistory>, ModelError> {
        let bad = |what: &str| Err(SyntheticError::Histories(what.to_string()).into());
        if self.num_topics == 0 || self.num_items < self.num_topics {
            return bad("every topic needs an item: num_items >= num_topics >= 1");
        }
        if self.max_len < MIN_LEN {
            return bad("max_len is at least 3 (train, validate, test)");
        }
        let finite_positive = |v: f64| v.is_finite() && v > 0.0;
        if !finite_positive(self.length_alpha) || !finite_positive(self.popularity_alpha) {
            return bad("length_alpha and popularity_alpha are finite and above 0");
        }
        if !(0.0..=1.0).contains(&self.drift) || !(0.0..=1.0).contains(&self.session_start) {
            return bad("drift and session_start are chances, within 0 and 1");
        }
        let per_topic = self.num_items / self.num_topics;
        let popularity = Zipf::new(per_topic, self.popularity_alpha);
        let lengths = Zipf::new(self.max_len - MIN_LEN + 1, self.length_alpha);
        let mut rng = Rng::new(self.seed);
        let mut actions_rng = Rng::new(self.seed ^ 0x5eed_ac71);
        let mut session_rng = Rng::new(self.seed ^ 0x5e55_1025);
        Ok((0..self.num_users)
            .map(|_| {
                let len = MIN_LEN + lengths.draw(&mut rng);
                let mut topic = (rng.next_u64() % self.num_topics as u64) as usize;
                let mut time = 1_600_000_000 + (rng.next_u64() % 10_000_000) as i64;
                let mut history = UserHistory {
                    items: Vec::with_capacity(len),
                    timestamps: Vec::with_capacity(len),
                    actions: Vec::with_capacity(len),
                };
                let home = topic;
                let propensity = 0.1 + 0.8 * unit(&mut actions_rng);
                for k in 0..len {
                    if unit(&mut rng) < self.drift {
                        topic = (rng.next_u64() % self.num_topics as u64) as usize;
                    }
                    // Sessions draw from their own stream: without them the
                    // histories are those of earlier versions.
                    let new_session = k > 0
                        && self.session_start > 0.0
                        && unit(&mut session_rng) < self.session_start;
                    if new_session {
                        topic = match unit(&mut session_rng) < 0.8 {
                            true => home,
                            false => session_rng.below(self.num_topics as u64) as usize,
                        };
                    }
                    let rank = popularity.draw(&mut rng);
                    let item = rank * self.num_topics + topic;
                    history.items.push(item as i64);
                    history.actions.push(synthetic_action(
                        &mut actions_rng,
                        item % self.num_topics == home,
                        propensity,
                        item,
                    ));
                    // Minutes to a day apart; with sessions, minutes
                    // within one and days between.
                    let gap = 60 + (rng.next_u64() % 86_400) as i64;
                    time += match (self.session_start > 0.0, new_session) {
                        (false, _) => gap,
                        (true, false) => 60 + gap % 3600,
                        (true, true) => 86_400 * (3 + session_rng.below(28) as i64),
                    };
                    history.timestamps.push(time);
                }
                history
            })
            .collect())
    }
}

/// Users' histories split for evaluation by leaving out their last items,
/// as SASRec's and HSTU's references evaluate (held 1: the last item is
/// the test item, the one before it the validation item).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LeaveOut {
    /// Each user's history less its last `2 * held` items (every item of
    /// a user too short to evaluate).
    pub train: Vec<UserHistory>,
    /// Each evaluated user's history less its last `held` items: the
    /// held-out validation items end it.
    pub valid: Vec<UserHistory>,
    /// Each evaluated user's whole history: the test items end it.
    pub test: Vec<UserHistory>,
}

impl LeaveOut {
    /// Splits `users`, holding out `held` items a user for validation and
    /// `held` for test; users of fewer than `2 * held + 2` items train on
    /// every item and are not evaluated.
    pub fn split(users: &[UserHistory], held: usize) -> Self {
        let mut out = Self::default();
        let shortest = held.saturating_mul(2).saturating_add(2);
        for u in users {
            if u.items.len() < shortest {
                out.train.push(u.clone());
            } else {
                out.train.push(u.without_last(2 * held));
                out.valid.push(u.without_last(held));
                out.test.push(u.clone());
            }
        }
        out
    }
}

/// Bit 0 (engaged) and bit 1 (liked) of a synthetic action.
fn synthetic_action(rng: &mut Rng, home_topic: bool, propensity: f64, item: usize) -> i64 {
    let engaged = unit(rng) < if home_topic { 0.8 } else { 0.3 };
    // Good items: half of them, spread over topics and popularity by a hash.
    let good = (item as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 63 == 1;
    let logit = (propensity / (1.0 - propensity)).ln() + if good { 1.5 } else { -1.5 };
    let liked = unit(rng) < 1.0 / (1.0 + (-logit).exp());
    i64::from(engaged) | i64::from(liked) << 1
}

/// Batches of `batch_size` histories (the last one shorter), each cut to
/// its most recent `max_len` items: the [`HISTORY_FEATURE`] with seconds
/// since the history's first item as weights (and, when every history of
/// the batch has actions, the [`ACTIONS_FEATURE`]), no dense features, a zero
/// label a user. Histories of fewer than 2 items are left out (nothing
/// to predict).
pub fn history_batches(
    users: &[UserHistory],
    batch_size: usize,
    max_len: usize,
) -> Result<Vec<Batch>, ModelError> {
    let bad = |what: String| Err(crate::BatchError::Histories(what).into());
    if max_len < 2 {
        return bad(format!(
            "max_len {max_len}: a history batch needs 2 items a user"
        ));
    }
    if let Some(u) = users
        .iter()
        .position(|u| u.items.len() != u.timestamps.len())
    {
        return bad(format!(
            "user {u} has {} items and {} timestamps",
            users[u].items.len(),
            users[u].timestamps.len()
        ));
    }
    let users: Vec<&UserHistory> = users.iter().filter(|u| u.items.len() >= 2).collect();
    users
        .chunks(batch_size.max(1))
        .map(|chunk| {
            let (mut ids, mut weights, mut lengths) = (Vec::new(), Vec::new(), Vec::new());
            let with_actions = chunk.iter().all(|u| u.actions.len() == u.items.len());
            let mut actions = Vec::new();
            for u in chunk {
                let from = u.items.len().saturating_sub(max_len);
                ids.extend_from_slice(&u.items[from..]);
                let first = u.timestamps[from];
                weights.extend(
                    u.timestamps[from..]
                        .iter()
                        .map(|&t| t.saturating_sub(first) as f32),
                );
                lengths.push((u.items.len() - from) as i64);
                if with_actions {
                    actions.extend_from_slice(&u.actions[from..]);
                }
            }
            let mut keys = vec![HISTORY_FEATURE.to_string()];
            if with_actions {
                // The actions ride as a second feature of the same lengths
                // (their weights: the same seconds).
                keys.push(ACTIONS_FEATURE.to_string());
                ids.extend(actions);
                lengths.extend_from_within(..);
                weights.extend_from_within(..);
            }
            let sparse = KeyedJaggedTensor::from_lengths(keys, ids, &lengths, Some(weights))?;
            Ok(Batch {
                dense: Tensor::zeros(chunk.len(), 0),
                sparse,
                labels: vec![0.0; chunk.len()],
            })
        })
        .collect()
}

/// One batch's tokens, as the model reads it.
pub(crate) struct Tokens {
    /// Each user's inputs: its history without the last item.
    pub(crate) input_lengths: Vec<usize>,
    /// Inputs' item ids and seconds.
    pub(crate) ids: Vec<i64>,
    pub(crate) times: Vec<i64>,
    /// Each user's last item and its seconds: the next item of its last input.
    pub(crate) last: Vec<(i64, i64)>,
}

impl Tokens {
    /// The tokens of `batch`'s [`HISTORY_FEATURE`].
    pub(crate) fn of(batch: &Batch) -> Result<Self, ModelError> {
        let kjt = &batch.sparse;
        let k = kjt
            .key_index(HISTORY_FEATURE)
            .ok_or_else(|| ember_sparse::SparseError::MissingFeature(HISTORY_FEATURE.into()))?;
        let b = kjt.stride();
        let offsets = &kjt.offsets()[k * b..=(k + 1) * b];
        let weights = kjt.weights();
        let time = |p: usize| weights.map_or(0, |w| w[p] as i64);
        let mut t = Tokens {
            input_lengths: Vec::with_capacity(b),
            ids: Vec::new(),
            times: Vec::new(),
            last: Vec::with_capacity(b),
        };
        for s in 0..b {
            let (start, end) = (offsets[s], offsets[s + 1]);
            let n = (end - start).saturating_sub(1);
            t.input_lengths.push(n);
            t.ids.extend_from_slice(&kjt.values()[start..start + n]);
            t.times.extend((start..start + n).map(time));
            t.last.push(match end > start {
                true => (kjt.values()[end - 1], time(end - 1)),
                false => (0, 0),
            });
        }
        Ok(t)
    }

    /// Each user's inputs cut to the last `max`.
    pub(crate) fn cut(mut self, max: usize) -> Tokens {
        if self.input_lengths.iter().all(|&n| n <= max) {
            return self;
        }
        let (mut ids, mut times, mut at) = (Vec::new(), Vec::new(), 0);
        for n in self.input_lengths.iter_mut() {
            let skip = n.saturating_sub(max);
            ids.extend_from_slice(&self.ids[at + skip..at + *n]);
            times.extend_from_slice(&self.times[at + skip..at + *n]);
            at += *n;
            *n -= skip;
        }
        self.ids = ids;
        self.times = times;
        self
    }

    /// Each user's last item, checked to be one of `items` (a user without
    /// items: `None`).
    pub(crate) fn last_items(&self, items: usize) -> Result<Vec<Option<usize>>, ModelError> {
        (self.last.iter().zip(&self.input_lengths))
            .enumerate()
            .map(|(b, (&(id, _), &n))| match (n, id) {
                (0, _) => Ok(None),
                (_, id) if id >= 0 && (id as usize) < items => Ok(Some(id as usize)),
                (_, id) => Err(ember_sparse::SparseError::IdOutOfRange {
                    table: "items".into(),
                    feature: HISTORY_FEATURE.into(),
                    sample: b,
                    id,
                    rows: items,
                }
                .into()),
            })
            .collect()
    }

    /// The lookup of the inputs (the [`HISTORY_FEATURE`]) and of `per`
    /// target items an input (the `targets` feature), `targets` in input
    /// order.
    pub(crate) fn lookup(
        &self,
        targets: Vec<i64>,
        per: usize,
    ) -> Result<KeyedJaggedTensor, ModelError> {
        let lengths: Vec<i64> = (self.input_lengths.iter().map(|&n| n as i64))
            .chain(self.input_lengths.iter().map(|&n| (per * n) as i64))
            .collect();
        let keys = vec![HISTORY_FEATURE.to_string(), TARGETS_FEATURE.to_string()];
        let ids = self.ids.iter().copied().chain(targets).collect();
        Ok(KeyedJaggedTensor::from_lengths(keys, ids, &lengths, None)?)
    }

    /// Each input's next item: the following input, or the user's last item.
    pub(crate) fn next_items(&self) -> Vec<i64> {
        let mut next = Vec::with_capacity(self.ids.len());
        let mut at = 0;
        for (b, &n) in self.input_lengths.iter().enumerate() {
            if n > 0 {
                next.extend_from_slice(&self.ids[at + 1..at + n]);
                next.push(self.last[b].0);
            }
            at += n;
        }
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(n: i64) -> UserHistory {
        UserHistory {
            items: (0..n).collect(),
            timestamps: (0..n).collect(),
            actions: Vec::new(),
        }
    }

    #[test]
    fn leave_out_holds_the_last_items_of_long_enough_users() {
        let users = [user(3), user(4), user(7)];
        let split = LeaveOut::split(&users, 1);
        // 3 items: too short to evaluate (fewer than 2 held + 2), trains whole.
        let items = |us: &[UserHistory]| us.iter().map(|u| u.items.len()).collect::<Vec<_>>();
        assert_eq!(items(&split.train), [3, 2, 5]);
        assert_eq!(items(&split.valid), [3, 6]);
        assert_eq!(items(&split.test), [4, 7]);
        let ranking = LeaveOut::split(&users, 2);
        assert_eq!(items(&ranking.train), [3, 4, 3]);
        assert_eq!(items(&ranking.test), [7]);
    }
}
