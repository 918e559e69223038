//! The server's metrics in Prometheus's text format (`GET /metrics`),
//! under Triton's names where Triton has one (`nv_inference_*`, cumulative
//! microseconds), so that dashboards made for Triton read them; Ember's
//! own (`ember_*`) add histograms, the model's version, reloads and the
//! disk tier's cache.

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};

/// Why a request failed, as the `reason` label of
/// `nv_inference_request_failure` says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// Malformed (400) or for another model (404).
    BadRequest,
    /// Shed: the server held as many requests as it takes (503).
    Rejected,
    /// Its deadline passed before its batch ran (503).
    Timeout,
    /// The client went away before its batch ran.
    Canceled,
    /// The model failed or panicked (500).
    Backend,
}

impl Failure {
    fn label(self) -> &'static str {
        match self {
            Failure::BadRequest => "BAD_REQUEST",
            Failure::Rejected => "REJECTED",
            Failure::Timeout => "TIMEOUT",
            Failure::Canceled => "CANCELED",
            Failure::Backend => "BACKEND",
        }
    }
}

/// Every figure the server keeps.
pub struct Metrics {
    registry: Registry,
    /// Requests answered with scores.
    pub success: IntCounter,
    failure: IntCounterVec,
    /// Samples scored.
    pub inferences: IntCounter,
    /// Batches the model ran.
    pub executions: IntCounter,
    /// Microseconds from a request's arrival to its answer, summed.
    pub request_us: IntCounter,
    /// Microseconds requests waited in the queue, summed.
    pub queue_us: IntCounter,
    /// Microseconds joining requests into batches, summed over requests.
    pub input_us: IntCounter,
    /// Microseconds of the model's forward, summed over requests.
    pub infer_us: IntCounter,
    /// Microseconds splitting a batch's scores into answers, summed over requests.
    pub output_us: IntCounter,
    /// Requests held now (being read, queued or computed).
    pub pending: IntGauge,
    /// Samples a batch.
    pub batch_size: Histogram,
    /// Seconds from a request's arrival to its answer.
    pub request_seconds: Histogram,
    /// Seconds a request waited in the queue.
    pub queue_seconds: Histogram,
    /// The version serving (1, then one more at each reload).
    pub version: IntGauge,
    /// Checkpoints loaded after the first.
    pub reloads: IntCounter,
    /// Checkpoints refused (the old model kept serving).
    pub reload_failures: IntCounter,
    /// The disk tier's lookups and misses (the model's since it loaded).
    pub cache_lookups: IntGauge,
    /// See `cache_lookups`.
    pub cache_misses: IntGauge,
}

impl Metrics {
    /// Metrics of the model named `model`.
    pub fn new(model: &str) -> Self {
        let registry = Registry::new();
        let opts = |name: &str, help: &str| Opts::new(name, help).const_label("model", model);
        let counter = |name: &str, help: &str| {
            let c = IntCounter::with_opts(opts(name, help)).expect("a valid metric");
            registry
                .register(Box::new(c.clone()))
                .expect("one metric a name");
            c
        };
        let gauge = |name: &str, help: &str| {
            let g = IntGauge::with_opts(opts(name, help)).expect("a valid metric");
            registry
                .register(Box::new(g.clone()))
                .expect("one metric a name");
            g
        };
        let histogram = |name: &str, help: &str, buckets: Vec<f64>| {
            let o = HistogramOpts::new(name, help)
                .const_label("model", model)
                .buckets(buckets);
            let h = Histogram::with_opts(o).expect("a valid metric");
            registry
                .register(Box::new(h.clone()))
                .expect("one metric a name");
            h
        };
        let failure = IntCounterVec::new(
            opts(
                "nv_inference_request_failure",
                "Failed inference requests, by reason",
            ),
            &["reason"],
        )
        .expect("a valid metric");
        registry
            .register(Box::new(failure.clone()))
            .expect("one metric a name");
        // 100 us to 10 s, at 1, 2.5 and 5 a decade.
        let seconds: Vec<f64> = (-4..=1)
            .flat_map(|e| [1.0, 2.5, 5.0].map(|m| m * 10f64.powi(e)))
            .take_while(|&s| s <= 10.0)
            .collect();
        let samples: Vec<f64> = (0..=16).map(|e| (1u64 << e) as f64).collect();
        Self {
            success: counter(
                "nv_inference_request_success",
                "Inference requests answered with scores",
            ),
            failure,
            inferences: counter("nv_inference_count", "Samples scored"),
            executions: counter("nv_inference_exec_count", "Batches the model ran"),
            request_us: counter(
                "nv_inference_request_duration_us",
                "Cumulative microseconds from a request's arrival to its answer",
            ),
            queue_us: counter(
                "nv_inference_queue_duration_us",
                "Cumulative microseconds requests waited in the queue",
            ),
            input_us: counter(
                "nv_inference_compute_input_duration_us",
                "Cumulative microseconds joining requests into batches",
            ),
            infer_us: counter(
                "nv_inference_compute_infer_duration_us",
                "Cumulative microseconds of the model's forward",
            ),
            output_us: counter(
                "nv_inference_compute_output_duration_us",
                "Cumulative microseconds splitting scores into answers",
            ),
            pending: gauge(
                "nv_inference_pending_request_count",
                "Requests held now: being read, queued or computed",
            ),
            batch_size: histogram("ember_batch_size", "Samples a batch the model ran", samples),
            request_seconds: histogram(
                "ember_request_duration_seconds",
                "Seconds from a request's arrival to its answer",
                seconds.clone(),
            ),
            queue_seconds: histogram(
                "ember_queue_duration_seconds",
                "Seconds a request waited in the queue",
                seconds,
            ),
            version: gauge("ember_model_version", "The model version serving"),
            reloads: counter(
                "ember_model_reloads_total",
                "Checkpoints loaded after the first",
            ),
            reload_failures: counter(
                "ember_model_reload_failures_total",
                "Checkpoints refused; the model before kept serving",
            ),
            cache_lookups: gauge(
                "ember_disk_tier_cache_lookups",
                "Ids the disk tier's tables looked up since the model loaded",
            ),
            cache_misses: gauge(
                "ember_disk_tier_cache_misses",
                "Of those, the rows read from the tables' files",
            ),
            registry,
        }
    }

    /// Counts a failed request.
    pub fn failed(&self, why: Failure) {
        self.failure.with_label_values(&[why.label()]).inc();
    }

    /// Everything, in Prometheus's text format.
    pub fn render(&self) -> String {
        let mut text = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut text)
            .expect("the text format writes into memory");
        String::from_utf8(text).expect("the text format is UTF-8")
    }
}

/// The content type of [`Metrics::render`].
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
