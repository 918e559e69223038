//! Dynamic batching, as Triton's dynamic batcher: requests queue, and the
//! oldest waits up to a maximum queue delay for others to join it in one
//! batch of at most the maximum batch size. One model instance runs the
//! batches, one at a time, its lookups and layers on a pool of threads of
//! its own. A request past its deadline, or whose client left, is dropped
//! before its batch runs; a full server sheds new requests. A model that
//! fails or panics on a batch of several requests runs each alone, so only
//! the request at fault fails. A new model (hot reload) is swapped in
//! between batches: the batch running finishes on the old one.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::inputs::{Inputs, Samples};
use crate::metrics::{Failure, Metrics};
use crate::model::Scorer;
use crate::ServeError;

/// How requests are batched and how many are held.
#[derive(Clone, Copy, Debug)]
pub struct BatchOptions {
    /// How long the oldest queued request waits for others to join its
    /// batch (Triton's `max_queue_delay_microseconds`; zero: it runs with
    /// those queued already).
    pub max_queue_delay: Duration,
    /// Requests the server holds at once (being read, queued or computed);
    /// one more is shed with a 503.
    pub max_queue_size: usize,
    /// A request's deadline when it gives none (Triton's
    /// `default_timeout_microseconds`; `None`: no deadline).
    pub default_timeout: Option<Duration>,
    /// Threads of the model's lookups and layers (`None`: every core).
    pub threads: Option<usize>,
}

impl Default for BatchOptions {
    /// 1 ms of queue delay, 1024 requests held, no deadline, every core.
    fn default() -> Self {
        Self {
            max_queue_delay: Duration::from_millis(1),
            max_queue_size: 1024,
            default_timeout: None,
            threads: None,
        }
    }
}

/// A request's scores, and the model version that gave them.
#[derive(Debug)]
pub struct Scored {
    /// One logit a sample.
    pub logits: Vec<f32>,
    /// The version of the model that scored them.
    pub version: u64,
}

/// A request waiting for its batch.
struct Job {
    samples: Samples,
    queued: Instant,
    deadline: Option<Instant>,
    reply: oneshot::Sender<Result<Scored, ServeError>>,
}

/// The queue and what the batching thread is told.
struct Queue {
    jobs: VecDeque<Job>,
    /// A model to swap in before the next batch, and its version.
    next_model: Option<(Box<dyn Scorer>, u64)>,
    stop: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    held: AtomicUsize,
    version: AtomicU64,
    metrics: Arc<Metrics>,
    options: BatchOptions,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The batching thread and its queue.
pub struct Batcher {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
}

/// A request held by the server; let go when dropped.
pub struct Permit(Arc<Shared>);

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::AcqRel);
        self.0.metrics.pending.dec();
    }
}

impl Batcher {
    /// Starts the batching thread over `scorer` (version 1) reading
    /// `inputs`' requests.
    pub fn start(
        scorer: Box<dyn Scorer>,
        inputs: Arc<Inputs>,
        options: BatchOptions,
        metrics: Arc<Metrics>,
    ) -> Result<Self, ServeError> {
        if options.max_queue_size == 0 {
            return Err(ServeError::Config(
                "the queue must hold at least 1 request".into(),
            ));
        }
        let mut pool = rayon::ThreadPoolBuilder::new().thread_name(|i| format!("ember-infer-{i}"));
        if let Some(n) = options.threads {
            if n == 0 {
                return Err(ServeError::Config("threads must be at least 1".into()));
            }
            pool = pool.num_threads(n);
        }
        let pool = pool
            .build()
            .map_err(|e| ServeError::Config(format!("the inference threads: {e}")))?;
        metrics.version.set(1);
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                next_model: None,
                stop: false,
            }),
            wake: Condvar::new(),
            held: AtomicUsize::new(0),
            version: AtomicU64::new(1),
            metrics,
            options,
        });
        let worker = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("ember-batcher".into())
                .spawn(move || run(&shared, scorer, &inputs, &pool))?
        };
        Ok(Self {
            shared,
            worker: Some(worker),
        })
    }

    /// Holds one more request, or refuses it (503) when the server holds
    /// as many as it takes.
    pub fn admit(&self) -> Result<Permit, ServeError> {
        let s = &self.shared;
        let limit = s.options.max_queue_size;
        let held = s.held.fetch_add(1, Ordering::AcqRel);
        s.metrics.pending.inc();
        let permit = Permit(Arc::clone(s));
        if held >= limit {
            s.metrics.failed(Failure::Rejected);
            return Err(ServeError::Unavailable(format!(
                "the server holds {limit} requests, as many as it takes (--max-queue-size): try again"
            )));
        }
        Ok(permit)
    }

    /// Queues a request's samples; the answer comes on the receiver. A
    /// `timeout` (else the default one) from `arrived` is its deadline.
    pub fn submit(
        &self,
        samples: Samples,
        arrived: Instant,
        timeout: Option<Duration>,
    ) -> oneshot::Receiver<Result<Scored, ServeError>> {
        let (reply, answer) = oneshot::channel();
        let timeout = timeout.or(self.shared.options.default_timeout);
        let job = Job {
            samples,
            queued: Instant::now(),
            deadline: timeout.map(|t| arrived + t),
            reply,
        };
        let mut queue = self.shared.lock();
        if queue.stop {
            drop(queue);
            let _ = job.reply.send(Err(ServeError::Unavailable(
                "the server is stopping".into(),
            )));
        } else {
            queue.jobs.push_back(job);
            drop(queue);
            self.shared.wake.notify_one();
        }
        answer
    }

    /// Serves `scorer` as `version` from the next batch on; the batch
    /// running finishes on the model before.
    pub fn swap(&self, scorer: Box<dyn Scorer>, version: u64) {
        self.shared.lock().next_model = Some((scorer, version));
        self.shared.wake.notify_one();
    }

    /// The version serving.
    pub fn version(&self) -> u64 {
        self.shared.version.load(Ordering::Acquire)
    }

    /// The metrics it keeps.
    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }
}

impl Drop for Batcher {
    /// Answers the requests queued, then stops the thread.
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.wake.notify_all();
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

/// The batching thread: forms batches and runs them until stopped.
fn run(shared: &Shared, mut scorer: Box<dyn Scorer>, inputs: &Inputs, pool: &rayon::ThreadPool) {
    let m = &shared.metrics;
    loop {
        let (jobs, swapped) = {
            let mut queue = shared.lock();
            let mut swapped = None;
            loop {
                if let Some(next) = queue.next_model.take() {
                    swapped = Some(next);
                    break;
                }
                drop_stale(&mut queue.jobs, m);
                if !queue.jobs.is_empty() || queue.stop {
                    break;
                }
                queue = shared.wake.wait(queue).unwrap_or_else(|p| p.into_inner());
            }
            if swapped.is_some() {
                (Vec::new(), swapped)
            } else if queue.jobs.is_empty() {
                return; // stopping, nothing left
            } else {
                (
                    take_batch(shared, queue, inputs.limits().max_batch_size),
                    None,
                )
            }
        };
        if let Some((next, version)) = swapped {
            // The old model drops here, after its last batch.
            scorer = next;
            shared.version.store(version, Ordering::Release);
            m.version.set(version as i64);
            continue;
        }
        if !jobs.is_empty() {
            pool.install(|| execute(shared, scorer.as_mut(), inputs, jobs));
            if let Some((lookups, misses)) = scorer.cache() {
                m.cache_lookups.set(lookups as i64);
                m.cache_misses.set(misses as i64);
            }
        }
    }
}

/// Answers and removes the queued requests past their deadline, and
/// removes those whose client left.
fn drop_stale(jobs: &mut VecDeque<Job>, m: &Metrics) {
    let now = Instant::now();
    let stale = |j: &Job| j.reply.is_closed() || j.deadline.is_some_and(|d| d <= now);
    if !jobs.iter().any(stale) {
        return;
    }
    for job in std::mem::take(jobs) {
        if job.reply.is_closed() {
            m.failed(Failure::Canceled);
        } else if let Some(deadline) = job.deadline.filter(|&d| d <= now) {
            m.failed(Failure::Timeout);
            let late = (now - deadline).as_micros();
            let _ = job.reply.send(Err(ServeError::Unavailable(format!(
                "request timeout expired: its deadline passed {late} us before its batch ran"
            ))));
        } else {
            jobs.push_back(job);
        }
    }
}

/// The next batch: the oldest request and those that join it within the
/// queue delay, up to `max_samples`.
fn take_batch(shared: &Shared, mut queue: MutexGuard<'_, Queue>, max_samples: usize) -> Vec<Job> {
    let close_at = queue.jobs[0].queued + shared.options.max_queue_delay;
    let mut jobs = Vec::new();
    let mut samples = 0;
    loop {
        drop_stale(&mut queue.jobs, &shared.metrics);
        while let Some(job) = queue.jobs.front() {
            if samples + job.samples.count() > max_samples && !jobs.is_empty() {
                return jobs; // the next request does not fit: the batch is full
            }
            samples += job.samples.count();
            jobs.extend(queue.jobs.pop_front());
        }
        let now = Instant::now();
        if samples >= max_samples || now >= close_at || queue.stop || queue.next_model.is_some() {
            return jobs;
        }
        queue = (shared.wake.wait_timeout(queue, close_at - now))
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

/// Runs one batch and answers its requests; a failure or a panic on
/// several requests runs each alone.
fn execute(shared: &Shared, scorer: &mut dyn Scorer, inputs: &Inputs, jobs: Vec<Job>) {
    let m = &shared.metrics;
    let version = shared.version.load(Ordering::Acquire);
    let start = Instant::now();
    for job in &jobs {
        let waited = start - job.queued;
        m.queue_us.inc_by(waited.as_micros() as u64);
        m.queue_seconds.observe(waited.as_secs_f64());
    }
    let parts: Vec<&Samples> = jobs.iter().map(|j| &j.samples).collect();
    let scored = score(scorer, inputs, &parts, m);
    match scored {
        Ok(logits) => {
            let split = Instant::now();
            let mut at = 0;
            for job in jobs {
                let n = job.samples.count();
                let mine = logits[at..at + n].to_vec();
                at += n;
                let _ = job
                    .reply
                    .send(check_finite(mine, inputs).map(|logits| Scored { logits, version }));
            }
            m.output_us.inc_by(split.elapsed().as_micros() as u64);
        }
        Err(e) if jobs.len() == 1 => {
            let job = jobs.into_iter().next().expect("one job");
            let _ = job.reply.send(Err(e));
        }
        Err(_) => {
            for job in jobs {
                let alone = score(scorer, inputs, &[&job.samples], m)
                    .and_then(|logits| check_finite(logits, inputs))
                    .map(|logits| Scored { logits, version });
                let _ = job.reply.send(alone);
            }
        }
    }
}

/// The model's logits for `parts` joined, a panic caught as an error.
fn score(
    scorer: &mut dyn Scorer,
    inputs: &Inputs,
    parts: &[&Samples],
    m: &Metrics,
) -> Result<Vec<f32>, ServeError> {
    let start = Instant::now();
    let batch = inputs.batch(parts)?;
    let joined = Instant::now();
    let count = batch.labels.len();
    let result = catch_unwind(AssertUnwindSafe(|| scorer.score(&batch)));
    let done = Instant::now();
    m.executions.inc();
    m.batch_size.observe(count as f64);
    let requests = parts.len() as u64;
    m.input_us
        .inc_by((joined - start).as_micros() as u64 * requests);
    m.infer_us
        .inc_by((done - joined).as_micros() as u64 * requests);
    match result {
        Ok(Ok(logits)) if logits.len() == count => {
            m.inferences.inc_by(count as u64);
            Ok(logits)
        }
        Ok(Ok(logits)) => Err(ServeError::Internal(format!(
            "the model gave {} scores for {count} samples",
            logits.len()
        ))),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(ServeError::Internal(
            "the model panicked on this request; the server goes on".into(),
        )),
    }
}

/// `logits`, or a 500 naming the first sample whose logit is not finite.
fn check_finite(logits: Vec<f32>, inputs: &Inputs) -> Result<Vec<f32>, ServeError> {
    match logits.iter().position(|z| !z.is_finite()) {
        None => Ok(logits),
        Some(at) => Err(ServeError::Internal(format!(
            "model '{}' gave a non-finite logit ({}) for sample {at} of the request",
            inputs.name(),
            logits[at]
        ))),
    }
}
